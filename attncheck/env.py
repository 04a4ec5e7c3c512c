"""The process environment of an attncheck run: the platform, the simulated device count,
and the code generation that makes a run's numbers the same on every runner.

Set only when a run asks for attncheck (the pytest plugin is inert otherwise), before jax
creates its backends and before NumPy is imported: XLA reads its flags and the device
count when the CPU backend starts, NumPy chooses its SIMD kernels when it is imported.

Why the code generation is fixed (jax 0.12.0.1, numpy 2.5.5, on an x86 host with AVX-512
and AVX512-BF16): a record's errors and budgets depend on every rounding of the kernel,
the yardstick and the oracle, and each of these chose its code by the host CPU.

- XLA compiles for the host's instruction set: AVX-512 and AVX2 code round a ring case's
  dv otherwise, enough to move its budget severalfold and its worst element to another
  key. ``--xla_cpu_max_isa`` caps it.
- XLA hands dots to YNNPACK, which picks its kernels by the CPU it finds, whatever
  ``--xla_cpu_max_isa`` says: on this host a bfloat16 dot sums each pair of products odd
  element first (``vdpbf16ps``). YNNPACK (and XNNPACK, oneDNN) are turned off; XLA's own
  code and Eigen remain. Their order of summation is still the platform's: a [8, 64] x
  [64, 16] bfloat16 dot summed its products in order on this host and in another order
  on an AMD EPYC with AVX2 and a 32 KiB L1d.
- Eigen splits a long dot across the threads of XLA's pool, one per CPU or per simulated
  device, whichever is more: a [4, 400000] x [400000, 4] float32 dot differs between 8
  and 16 threads. ``PJRT_NPROC=1`` holds the pool at the 8 simulated devices on any host.
- NumPy's float64 ``exp`` and ``log1p`` (the oracle's) differ between its AVX-512 and AVX2
  kernels; ``NPY_DISABLE_CPU_FEATURES`` caps them at the same level as XLA's.

What remains host-dependent, and so is part of the platform a run's numbers belong to
(``Platform``): the architecture, an ISA the host lacks (the level is then the host's),
the L1 data cache (Eigen blocks a dot's contraction by it: 400 float32 terms per block
with 32 KiB, 608 with 48 KiB), and the versions of jax, jaxlib and NumPy.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.metadata
import importlib.util
import os
import platform as _host
import re
import sys
from collections.abc import Mapping

# Ring kernels are verified on 1, 2, 4 and 8 simulated CPU devices.
HOST_DEVICE_COUNT = 8
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# "1": a TPU is there (use it), "0": ignore any TPU; unset: detect.
TPU_OVERRIDE_ENV = "ATTNCHECK_TPU"
# The instruction set a run's CPU code is generated for; "host" leaves every choice to the
# libraries (numbers then belong to this CPU alone).
ISA_ENV = "ATTNCHECK_CPU_ISA"
FIXED_ISA = "AVX2"
HOST = "host"
# x86-64 levels, lowest first: the flags /proc/cpuinfo shows for each, and the NumPy
# dispatch targets above it (disabled to hold NumPy at the level; NumPy ignores names it
# does not know and refuses to disable its baseline, x86-64-v2).
X86_LEVELS: Mapping[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "SSE4_2": (frozenset({"sse4_2"}), ("X86_V3", "X86_V4", "AVX512_ICL", "AVX512_SPR")),
    "AVX": (frozenset({"sse4_2", "avx"}), ("X86_V3", "X86_V4", "AVX512_ICL", "AVX512_SPR")),
    "AVX2": (frozenset({"sse4_2", "avx", "avx2", "fma"}), ("X86_V4", "AVX512_ICL", "AVX512_SPR")),
    "AVX512": (frozenset({"sse4_2", "avx", "avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq",
                          "avx512vl"}), ("AVX512_ICL", "AVX512_SPR")),
}
# Libraries XLA hands work to that choose their kernels by the host CPU.
LIBRARIES_OFF = ("--xla_cpu_experimental_ynn_fusion_type=", "--xla_cpu_experimental_xnn_fusion_type=",
                 "--xla_cpu_use_xnnpack=false", "--xla_cpu_use_onednn=false")
MAX_ISA_FLAG = "--xla_cpu_max_isa"
# XLA ends the process (SIGABRT) when a device reaches a collective more than its stuck
# warning's and its termination's timeouts (20 + 40 s by default) after another, with
# "Termination timeout ... Exiting to ensure a consistent program state". Interpreted
# kernels on several simulated devices, GIL-bound and on a loaded 2-core runner, can be that
# late without any deadlock. A run waits for them; a real deadlock is the watchdog's to end
# (attncheck.watchdog: a failing record naming the timeout, every thread's stack).
COLLECTIVE_FLAGS = ("--xla_cpu_collective_call_terminate_timeout_seconds=86400",
                    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300")
NUMPY_DISABLE_ENV = "NPY_DISABLE_CPU_FEATURES"
PJRT_THREADS_ENV = "PJRT_NPROC"


def tpu_present() -> bool:
    """Whether this machine has a TPU jax can use, without starting a jax backend: libtpu is
    installed and the kernel exposes accelerator devices. ``ATTNCHECK_TPU`` overrides."""
    override = os.environ.get(TPU_OVERRIDE_ENV, "")
    if override in ("0", "1"):
        return override == "1"
    if importlib.util.find_spec("libtpu") is None:
        return False
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def _backends_started() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(bridge is not None and getattr(bridge, "_backends", None))


# ------------------------------------------------------------------ the platform
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, feature flags) of the first CPU, from /proc/cpuinfo (empty elsewhere)."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()  # noqa: SIM115
    except OSError:
        return "", frozenset()
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    return (model.group(1).strip() if model else "", frozenset(flags.group(1).split()) if flags else frozenset())


def _l1d_kib() -> int | None:
    """The first CPU's level-1 data cache in KiB, from sysfs (None where it does not say)."""
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index[0-9]*")):
        try:
            level, kind, size = (open(f"{index}/{name}", encoding="ascii").read().strip()  # noqa: SIM115
                                 for name in ("level", "type", "size"))
        except OSError:
            continue
        if level == "1" and kind == "Data" and (found := re.fullmatch(r"(\d+)K", size)):
            return int(found.group(1))
    return None


def requested_isa() -> str:
    """The ISA this run's code is generated for (``$ATTNCHECK_CPU_ISA``, default AVX2)."""
    isa = os.environ.get(ISA_ENV, "").strip() or FIXED_ISA
    if isa != HOST and isa not in X86_LEVELS:
        raise ValueError(f"${ISA_ENV}={isa!r}: expected one of {', '.join(X86_LEVELS)} or {HOST!r}")
    return isa


def effective_isa(isa: str, machine: str, flags: frozenset[str]) -> str:
    """The level the code really is for: the requested one, or the host's highest below it
    (XLA never generates instructions the CPU lacks); ``host`` off x86-64 or when asked."""
    if isa == HOST or machine not in ("x86_64", "AMD64"):
        return HOST
    levels = list(X86_LEVELS)
    have = [name for name in levels if X86_LEVELS[name][0] <= flags]
    if not have:
        return HOST
    return levels[min(levels.index(isa), levels.index(have[-1]))]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the numbers of a run belong to: two runs on equal platforms compute the same
    records, bit for bit; budgets accepted on one platform are not judged on another
    (``attncheck.report.accepted``). ``cpu`` only informs."""

    machine: str  # x86_64, aarch64
    isa: str  # the instruction set XLA and NumPy generate code for; "host": not fixed
    l1d_kib: int | None  # Eigen blocks a dot's contraction by the L1 data cache
    jax: str
    jaxlib: str
    numpy: str
    cpu: str = dataclasses.field(default="", compare=False)

    def describe(self) -> str:
        code = "host code (not fixed)" if self.isa == HOST else f"{self.isa} code"
        cache = f", L1d {self.l1d_kib} KiB" if self.l1d_kib else ""
        return f"{self.machine} {code}{cache}; jax {self.jax}, jaxlib {self.jaxlib}, numpy {self.numpy}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> Platform:
        return cls(**{f.name: data.get(f.name, "") for f in dataclasses.fields(cls)})


@functools.cache
def current_platform() -> Platform:
    """The platform of this process' numbers (``configure`` has fixed its code generation)."""
    model, flags = _cpuinfo()
    machine = _host.machine()
    return Platform(machine=machine, isa=effective_isa(requested_isa(), machine, flags), l1d_kib=_l1d_kib(),
                    jax=_version("jax"), jaxlib=_version("jaxlib"), numpy=_version("numpy"), cpu=model)


# ------------------------------------------------------------------ configuring a process
def _flags_without(flags: str, *names: str) -> list[str]:
    return [f for f in flags.split() if f.split("=", 1)[0] not in names]


def codegen_settings(isa: str, machine: str) -> tuple[list[str], dict[str, str]]:
    """(XLA flags, environment variables) that fix the code generation at ``isa``."""
    if isa == HOST:
        return [], {}
    flags = list(LIBRARIES_OFF)
    variables = {PJRT_THREADS_ENV: "1"}
    if machine in ("x86_64", "AMD64"):
        flags.append(f"{MAX_ISA_FLAG}={isa}")
        variables[NUMPY_DISABLE_ENV] = " ".join(X86_LEVELS[isa][1])
    return flags, variables


def configure() -> list[str]:
    """Pin the CPU platform unless a TPU is present (jax would probe for accelerators on
    every worker start), ask XLA for HOST_DEVICE_COUNT CPU devices, fix the code generation
    (``$ATTNCHECK_CPU_ISA``) and let collectives wait for a late device (COLLECTIVE_FLAGS).
    A platform or device count the user chose wins; the code generation and the collective
    timeouts replace what the caller's XLA_FLAGS say of them (the records would otherwise
    depend on the caller). Processes started afterwards (xdist workers, a
    mutant's gate) inherit it all. Returns warnings: what could not be applied because jax
    or NumPy had already started."""
    warnings = []
    if not tpu_present() and "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
        if "jax" in sys.modules and not _backends_started():
            import jax

            jax.config.update("jax_platforms", "cpu")
    isa = requested_isa()
    machine = _host.machine()
    flags, variables = codegen_settings(isa if isa == HOST else effective_isa(isa, machine, _cpuinfo()[1]),
                                        machine)
    flags = [*flags, *COLLECTIVE_FLAGS]
    current = os.environ.get("XLA_FLAGS", "")
    replaced = [f for f in current.split() if f.split("=", 1)[0] in {g.split("=", 1)[0] for g in flags}
                and f not in flags]
    if replaced:
        warnings.append(f"the caller's XLA_FLAGS {' '.join(replaced)} replaced by attncheck's ({' '.join(flags)}); "
                        f"set {ISA_ENV}={HOST} to keep the caller's code generation")
    kept = _flags_without(current, *(g.split("=", 1)[0] for g in flags))
    if DEVICE_COUNT_FLAG not in current:
        kept.insert(0, f"{DEVICE_COUNT_FLAG}={HOST_DEVICE_COUNT}")
    wanted = " ".join(kept + flags)
    if _backends_started():
        if wanted != current:
            warnings.append("jax started its backends before attncheck could set XLA_FLAGS (the simulated "
                            "device count and the fixed code generation): cases on more devices than there "
                            "are fail, and this process' numbers are its host's")
    else:
        os.environ["XLA_FLAGS"] = wanted
    for name, value in variables.items():
        if name == NUMPY_DISABLE_ENV and "numpy" in sys.modules and os.environ.get(name) != value:
            warnings.append(f"NumPy was imported before attncheck could set ${name}; this process' oracle "
                            "numbers are its host's")
        os.environ[name] = value
    return warnings
