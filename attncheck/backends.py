"""How a kernel runs: the backends of the gate.

- ``interpret``: Pallas TPU interpret mode on CPU. Uninitialised memory is NaN (scratch read
  before it is written poisons the result instead of reading a lucky zero) and
  out-of-bounds reads raise with the exact range.
- ``interpret-hazards``: the same, plus the race detector with two simulated cores (so
  "parallel" grid dimensions are really split, as on a megacore chip), a shuffled parallel
  grid order, and DMAs executed only when waited on (a buffer read before ``wait()`` sees
  stale data). Variants rotate per case so every mode gets exercised in one run.
- ``tpu-lower``: ``jax.export`` for platform ``tpu`` of forward and gradient: proves the
  kernel lowers to Mosaic without a TPU; compares no numerics.
- ``tpu``: native execution when ``jax.devices()`` are TPUs.
- ``xla``: pure-JAX kernels on the default device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import jax
from jax.experimental.pallas import tpu as pltpu

from attncheck import env, interpret_compat
from attncheck.compiled import with_vjp

INTERPRET_BASE = dict(uninitialized_memory="nan", out_of_bounds_reads="raise")
# Hazard variants: each case runs under one of these, picked from the case's seed, so the
# run as a whole exercises races on 2 cores, a random parallel grid order, and both DMA
# execution modes (on_wait exposes reads before wait(); eager is what a lax TPU does).
HAZARD_VARIANTS = (
    dict(detect_races=True, num_cores_or_threads=2, dma_execution_mode="on_wait"),
    dict(detect_races=True, num_cores_or_threads=1, random_seed=1, dma_execution_mode="eager"),
    dict(detect_races=True, num_cores_or_threads=2, random_seed=7, dma_execution_mode="on_wait"),
)

# The hazard checks run on at most this many simulated devices, for time: with the race
# detector and two simulated cores per device a ring of 8 is among the slowest cases of
# the gate. Rings of 8 are still verified on the plain interpret backend and on XLA;
# hazards (races, DMA order) are per-device properties that 2 and 4 devices exercise.
MAX_HAZARD_DEVICES = 4
# And on rows of fewer keys than a long reduction: races and DMA order are properties of a
# kernel's steps that a few kv blocks exercise, and the race detector's cost grows with
# every kv block, many times what the block costs without it. The long rows' numerics are
# verified on the plain interpret backend.
MAX_HAZARD_SEQUENCE = 1023


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    compares_numerics: bool
    probe: Callable[[], str | None]  # None when available, else the reason it is not
    variants: tuple[dict, ...] = ()
    max_devices: int | None = None  # cases on more simulated devices are not run here
    max_sequence: int | None = None  # nor cases of a longer Params.sequence_length
    # The TPU generation (device kind) this backend emulates: what kernels that choose
    # defaults by generation see (interpret_compat.emulated_tpu), and what tpu-lower lowers
    # for. None: the real device's (tpu) or none (xla).
    tpu_device_kind: str | None = None

    def unavailable_reason(self) -> str | None:
        return self.probe()

    @property
    def reuses_programs(self) -> bool:
        """Whether cases of one program with other data run on its compile: not where the
        interpreter's settings rotate with the seed (each another program), nor where the
        program is lowered, not run (a case with other data lowers it again)."""
        return self.compares_numerics and not self.variants

    @property
    def interprets(self) -> bool:
        """Runs kernels in Pallas TPU interpret mode."""
        return self.name.startswith("interpret")

    def settings(self, seed: int = 0, devices: int = 1, cores: int | None = None) -> dict:
        """The interpreter settings a case with this seed on this many devices runs under
        ({} when native). ``cores``: the simulated cores per device the case needs (None:
        the backend's own choice): a kernel written for a megacore chip may hang on one core,
        so such a case gets that many in every variant (grid order and DMA modes still
        rotate)."""
        if not self.interprets:
            return {}
        if not self.runs_devices(devices):
            raise ValueError(f"backend {self.name} runs cases on at most {self.max_devices} devices; "
                             f"this case needs {devices}")
        variant = dict(self.variants[seed % len(self.variants)]) if self.variants else {}
        if cores is not None:
            variant["num_cores_or_threads"] = cores
        return {**INTERPRET_BASE, **variant}

    def recorded_settings(self, seed: int = 0, devices: int = 1, cores: int | None = None) -> dict:
        """What a record says the case ran under: the interpreter settings, the TPU
        generation emulated, and the platform its numbers belong to."""
        emulated = {"emulated_tpu": self.tpu_device_kind} if self.tpu_device_kind else {}
        return {**self.settings(seed, devices, cores), **emulated, "platform": env.current_platform().describe()}

    def runs_devices(self, devices: int) -> bool:
        return self.max_devices is None or devices <= self.max_devices

    def runs(self, params) -> bool:
        """Whether cases of these parameters run here (the caps above)."""
        return self.runs_devices(params.device_count) and (
            self.max_sequence is None or params.sequence_length <= self.max_sequence)

    @contextlib.contextmanager
    def context(self, seed: int = 0, devices: int = 1, cores: int | None = None
                ) -> Iterator[interpret_compat.InterpretedCalls | None]:
        """Run the kernel under this backend; the block gets the count of the interpreter's
        callbacks made in it (None when the backend does not interpret): what says a
        Pallas kernel ran there."""
        settings = self.settings(seed, devices, cores)
        if settings:
            try:
                with interpret_compat.emulated_tpu(self.tpu_device_kind), interpret_compat.ref_views(), \
                        interpret_compat.vmapped_grids(), interpret_compat.empty_accesses(), \
                        interpret_compat.host_callbacks() as calls, \
                        (interpret_compat.ordered_collectives() if devices > 1 else contextlib.nullcontext()), \
                        pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(**settings)):
                    yield calls
            except BaseException:
                # The interpreter's shared state is left inconsistent by an exception.
                pltpu.reset_tpu_interpret_mode_state()
                raise
        else:
            yield None


# The TPU generation the backends without a TPU emulate. Mosaic lowering asks it; without a
# TPU, an abstract mesh names it (and interpret_compat.emulated_tpu for the kernels that ask
# jax.devices()).
EMULATED_TPU = "TPU v5 lite"


def tpu_mesh(devices: int = 1, axis: str = "export", device_kind: str = EMULATED_TPU) -> jax.sharding.AbstractMesh:
    """An abstract mesh of ``devices`` TPUs of the emulated generation along ``axis``: what
    Mosaic lowering asks the TPU generation of, without a TPU. A sharded kernel's own
    ``shard_map`` runs over one of these to be exported. Its axis is Auto: the exported
    arguments carry no sharding of their own, and under an Explicit axis jax checks every
    intermediate's sharding against its rank (a kernel that reshapes its cache from 5 to
    4 dimensions, as tpu-inference's ragged paged attention v3 does, fails to export:
    "Length of sharding.spec (5) must be equal to aval's ndim (4)")."""
    return jax.sharding.AbstractMesh(
        (devices,), (axis,), (jax.sharding.AxisType.Auto,),
        abstract_device=jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu"))


def export_for_tpu(fn: Callable, *args, device_kind: str | None = EMULATED_TPU,
                   mesh: jax.sharding.AbstractMesh | None = None):
    """``jax.export`` of ``fn`` for platform tpu (arrays or ShapeDtypeStructs as args),
    under ``mesh`` (default: one TPU of ``device_kind``; ``tpu_mesh``).

    ``device_kind=None`` exports without an abstract mesh: a function that runs its own
    ``shard_map`` over the CPU devices must not be nested in another mesh (a sharded Pallas
    kernel whose lowering asks the TPU generation runs its shard_map over ``mesh`` instead).
    """
    structs = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    if device_kind is None:
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*structs)
    with jax.sharding.use_abstract_mesh(mesh or tpu_mesh(device_kind=device_kind)), \
            interpret_compat.emulated_tpu(device_kind):
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*structs)


def tpu_exports(forward: Callable, primals, cotangent, *rest, device_kind: str | None = EMULATED_TPU,
                mesh: jax.sharding.AbstractMesh | None = None) -> dict[str, Callable[[], object]]:
    """The tpu-lower directions of a differentiable kernel: thunks exporting
    ``forward(*primals, *rest)`` ("lower-fwd") and it with the VJP of its primals
    ("lower-grad")."""
    n = len(primals)
    options = dict(device_kind=device_kind, mesh=mesh)
    return {"lower-fwd": lambda: export_for_tpu(forward, *primals, *rest, **options),
            "lower-grad": lambda: export_for_tpu(lambda *a: with_vjp(forward)(a[:n], a[n], *a[n + 1:]),
                                                 *primals, cotangent, *rest, **options)}


def _always() -> str | None:
    return None


def _tpu_present() -> str | None:
    platforms = sorted({d.platform for d in jax.devices()})
    if "tpu" in platforms:
        return None
    return f"no TPU: jax.devices() are {', '.join(platforms)}"


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("interpret", True, _always, tpu_device_kind=EMULATED_TPU),
        Backend("interpret-hazards", True, _always, HAZARD_VARIANTS, max_devices=MAX_HAZARD_DEVICES,
                max_sequence=MAX_HAZARD_SEQUENCE, tpu_device_kind=EMULATED_TPU),
        Backend("tpu-lower", False, _always, tpu_device_kind=EMULATED_TPU),
        Backend("tpu", True, _tpu_present),
        Backend("xla", True, _always),
    )
}
