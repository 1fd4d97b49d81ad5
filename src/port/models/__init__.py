"""Equinox model modules, one per architecture family."""
