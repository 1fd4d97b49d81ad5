"""The public API: every name `port` exports resolves, and documents itself.

Functions name each argument under `**Arguments:**` and show a short example; classes
say what they hold. (The Python blocks of the README and docs/ run in test_docs.py.)
"""

import inspect

import pytest

import port


@pytest.mark.parametrize("name", port.__all__)
def test_every_export_is_documented(name):
    obj = getattr(port, name)
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"port.{name} has no docstring"
    if inspect.isfunction(obj):
        assert "**Arguments:**" in doc, f"port.{name}: no **Arguments:** list"
        assert "```python" in doc, f"port.{name}: no example"
        documented = doc.split("**Arguments:**", 1)[1]
        for parameter in inspect.signature(obj).parameters:
            assert f"`{parameter}`" in documented, f"port.{name}: argument `{parameter}` is not described"


def test_the_exports_are_the_listed_names():
    assert sorted(port.__all__) == sorted(set(port.__all__))
    assert port.__all__ == sorted(port._EXPORTS)  # the literal list and the lazy table agree
    assert {"convert", "load", "restore", "save", "make_mesh", "PortError"} <= set(port.__all__)
    with pytest.raises(AttributeError):
        _ = port.no_such_name


def _nn_names():
    import port.nn

    return sorted(
        name
        for name in dir(port.nn)
        if not name.startswith("_") and getattr(getattr(port.nn, name), "__module__", "").startswith("port.nn.")
    )


@pytest.mark.parametrize("name", _nn_names())
def test_every_layer_is_documented(name):
    """port.nn, the library of layers: each name says what it takes and returns, with an example."""
    import port.nn

    obj = getattr(port.nn, name)
    doc = inspect.getdoc(obj) or ""
    assert "```python" in doc, f"port.nn.{name}: no example"
    if inspect.isfunction(obj):
        assert "**Arguments:**" in doc and "**Returns:**" in doc, f"port.nn.{name}: no **Arguments:** / **Returns:**"
        documented = doc.split("**Arguments:**", 1)[1]
        for parameter in inspect.signature(obj).parameters:
            assert f"`{parameter}`" in documented, f"port.nn.{name}: argument `{parameter}` is not described"
    else:
        assert "**Arguments:**" in doc or "**Fields:**" in doc, f"port.nn.{name}: no **Arguments:** / **Fields:**"
