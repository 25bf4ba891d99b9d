"""What llama.cpp this process runs: the build, the CPU kernels chosen, the devices.

The wheel on PyPI carries llama.cpp's CPU backend compiled for several
x86-64 levels (``x64``, ``sse42``, ``sandybridge``, ``haswell``,
``skylakex``, ``icelake``, ``zen4``, ...; on ARM, several feature sets) and
llama.cpp loads the best one for the CPU it finds; ``cpu_variant`` names
it. A source build (``make dev``) links llama.cpp in, compiled for the
build machine's CPU, and has no variant.

>>> import lloyal
>>> info = lloyal.backend_info()
>>> "cpu" in [d.kind for d in info.devices]
True
>>> info.llama_cpp_2_version == lloyal.LLAMA_CPP_2_VERSION
True
"""

from __future__ import annotations

from dataclasses import dataclass

from lloyal import _lloyal

LLAMA_CPP_2_VERSION: str = _lloyal.LLAMA_CPP_2_VERSION
"""The llama-cpp-2 release lloyal is built against (it vendors llama.cpp)."""


@dataclass(frozen=True)
class Device:
    """One compute device llama.cpp found."""

    name: str
    """e.g. ``"CPU"``, ``"CUDA0"``."""
    description: str
    """The CPU or GPU model, as the backend reports it."""
    backend: str
    """``"CPU"``, ``"CUDA"``, ``"Metal"``, ..."""
    kind: str
    """``"cpu"``, ``"gpu"``, ``"igpu"``, ``"accel"`` or ``"unknown"``."""
    memory_total: int
    """Bytes (0 where the backend does not say)."""
    memory_free: int
    """Free bytes when ``backend_info()`` was called."""


@dataclass(frozen=True)
class BackendInfo:
    """How llama.cpp is built into this process and what it chose at run time."""

    version: str
    """lloyal's version."""
    llama_cpp_2_version: str
    """The pinned llama-cpp-2 release, which names the vendored llama.cpp."""
    dynamic_backends: bool
    """``True`` for the portable wheel (backends are modules chosen at run
    time), ``False`` for a source build compiled for the build machine."""
    cpu_variant: str | None
    """The CPU module llama.cpp chose (``"zen4"``, ``"haswell"``, ``"x64"``,
    ...); ``None`` in a source build."""
    module_dir: str | None
    """Where the backend modules were loaded from (wheel builds)."""
    cpu_features: tuple[str, ...]
    """The CPU features llama.cpp's kernels use, e.g. ``("AVX2", "FMA", ...)``."""
    system_info: str
    """llama.cpp's own one-line summary (``llama_print_system_info``)."""
    devices: tuple[Device, ...]
    """Every device found: the CPU, and GPUs where a GPU backend is present."""

    @property
    def gpu_backends(self) -> tuple[str, ...]:
        """Names of the GPU backends found (``("CUDA",)``, or ``()``)."""
        return tuple(dict.fromkeys(d.backend for d in self.devices if d.kind in ("gpu", "igpu")))


def backend_info() -> BackendInfo:
    """Describe the llama.cpp build in use and the devices it found.

    Initialises llama.cpp's backend if nothing has yet. ``lloyal info``
    prints the same.

    >>> import lloyal
    >>> info = lloyal.backend_info()
    >>> "CPU" in [d.backend for d in info.devices]
    True
    >>> isinstance(info.cpu_features, tuple)
    True
    """
    raw = _lloyal.backend_info()
    return BackendInfo(
        version=_lloyal.__version__,
        llama_cpp_2_version=raw["llama_cpp_2_version"],
        dynamic_backends=raw["dynamic_backends"],
        cpu_variant=raw["cpu_variant"],
        module_dir=raw["module_dir"],
        cpu_features=tuple(raw["cpu_features"]),
        system_info=raw["system_info"],
        devices=tuple(Device(**d) for d in raw["devices"]),
    )
