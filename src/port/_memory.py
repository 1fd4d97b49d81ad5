"""Peak anonymous host memory, sampled from `/proc/self/status` (`RssAnon`); what is available.

`ru_maxrss` also counts pages of the memory-mapped checkpoint; `RssAnon` does not.

```python
with PeakMemory() as peak:
    work()
peak.bytes
```
"""

from __future__ import annotations

import threading
from typing import Any


def rss_anon() -> int:
    """Current anonymous resident memory of this process, in bytes (0 where unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_host_bytes() -> int | None:
    """What the kernel says new allocations can take without swapping (`MemAvailable` in
    `/proc/meminfo`), in bytes; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(device_bytes: int, mesh: Any, label: str) -> None:
    """Refuse, before anything is allocated, blocks of `device_bytes` on each of this process's
    CPU devices of `mesh` (their memory is the host's) that take more than the host has
    available; `label` names the mesh in the message (`mesh=data=4,model=2`).

    It counts `device_bytes` once per device (`port plan` shows bytes per device): an upper
    bound, since the devices that hold one replicated block share its buffer (`place`).
    """
    import jax

    from ._errors import PlanError
    from ._text import size_text

    me = jax.process_index()
    cpus = sum(1 for d in mesh.devices.flat if d.process_index == me and d.platform == "cpu")
    need = cpus * device_bytes
    available = available_host_bytes()
    if cpus and available is not None and need > available:
        raise PlanError(
            [
                f"{label}: its blocks take {size_text(need)} of host memory ({cpus} CPU device{'s' if cpus > 1 else ''} x "
                f"{size_text(device_bytes)} each), more than the {size_text(available)} available; "
                "use fewer devices, or shard what is replicated"
            ]
        )


class PeakMemory:
    """Samples `rss_anon` on a thread every `interval` seconds while in use."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.bytes = max(self.bytes, rss_anon())

    def __enter__(self) -> PeakMemory:
        self.bytes = rss_anon()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, rss_anon())
