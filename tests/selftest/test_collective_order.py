"""Interpret mode on several simulated devices: collectives run in one order with the
interpreted kernels on every device (``interpret_compat.ordered_collectives``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lax import parallel
from jax.sharding import Mesh, PartitionSpec as P

from attncheck import interpret_compat

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ring_step(x, w):
    """A collective and a computation that do not depend on each other, then a sum."""
    n = jax.lax.axis_size("d")
    rotated = jax.lax.ppermute(x, "d", [(i, (i + 1) % n) for i in range(n)])
    return jax.lax.psum(jnp.sum(jnp.tanh(x * w) * rotated), "d")


def _loss_and_grads(x, w):
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    ring = jax.shard_map(_ring_step, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())

    def steps(x, w):  # the collectives inside a loop, as in a ring kernel
        return jax.lax.scan(lambda carry, _: (carry + ring(x, w * carry), None), 0.0, None, length=2)[0]

    return jax.value_and_grad(steps, argnums=(0, 1))(x, w)


def test_ordered_collectives_leave_values_and_gradients_as_they_were_and_restore_jax():
    args = (jnp.arange(16, dtype=jnp.float32).reshape(4, 4) / 7, jnp.float32(0.3))
    fn = jax.jit(interpret_compat.in_collective_order(_loss_and_grads))
    plain = fn(*args)
    with interpret_compat.ordered_collectives():
        jaxpr = str(jax.make_jaxpr(interpret_compat.in_collective_order(_loss_and_grads))(*args))
        ordered = jax.jit(interpret_compat.in_collective_order(_loss_and_grads))(*args)
    # Every collective, in the forward and the backward loop, between two ordered callbacks.
    collectives = len(re.findall(r"= (ppermute|psum|psum_invariant)\[", jaxpr))
    assert collectives >= 3 and jaxpr.count("ordered=True") == 2 * collectives, jaxpr
    assert "io_callback" not in str(jax.make_jaxpr(interpret_compat.in_collective_order(_loss_and_grads))(*args))
    assert parallel.ppermute_p.bind.__qualname__ == "Primitive.bind"
    for want, got in zip(jax.tree.leaves(plain), jax.tree.leaves(ordered)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# A ring flash case on 8 devices on the first hazard variant (two simulated cores). Without
# the ordering it deadlocks on a 2-core machine (7 devices at a collective-permute, the 8th
# at the interpreter's barrier of the next kernel). XLA's
# rendezvous timeout, cut to 30 s here, turns that hang into an abort, so the test fails
# instead of hanging.
_EIGHT_DEVICE_RING = """
    import dataclasses, json, sys
    from attncheck import env
    env.configure()
    from attncheck import check, specs
    from attncheck.backends import BACKENDS
    spec = specs.all_specs()["ring_flash_attention"]
    case = spec.case_from_json(json.loads(sys.argv[1]))
    impl = specs.resolve_impl("attncheck_kernels.ring_attention:ring_flash_attention_tpu_sharded")
    backend = dataclasses.replace(BACKENDS["interpret-hazards"], max_devices=None)
    outcome = check.check_case(check.Target(spec, "builtin", impl, backend), case, report_dir=None)
    print(json.dumps([[r.direction, r.outcome, r.reason] for r in outcome.records]))
"""

_CASE = {"family": "ring_flash_attention", "seed": 2965, "params": {
    "batch": 2, "bias": "neg_inf_rows", "causal": True, "check_vma": True, "devices": 8,
    "dtype": "float32", "flash_blocks": [["block_q", 256], ["block_k_major", 256], ["block_k", 128],
                                         ["block_b", 1], ["block_k_dkv", 256], ["block_k_dq", 128]],
    "float32_logits": False, "head_dim": 128, "heads": 1, "highest_precision": True,
    "per_device": 256, "placement": "count", "segment_dtype": "int32", "segment_starts": [0, 161],
    "segments": "packed", "seq_len": 2048, "single_segment_ids": False, "sm_scale": 0.3,
    "values": "normal", "vmem_limit_bytes": 67108864}}


def test_a_ring_on_eight_devices_with_two_simulated_cores_each_runs_to_the_end():
    environ = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    environ.update(PYTHONPATH=_REPO, XLA_FLAGS="--xla_cpu_collective_call_terminate_timeout_seconds=30")
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_EIGHT_DEVICE_RING), json.dumps(_CASE)],
                         env=environ, cwd=_REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"rc {run.returncode}\n{run.stderr[-3000:]}"
    records = json.loads(run.stdout.strip().splitlines()[-1])
    assert records and all(outcome == "pass" for _, outcome, _ in records), records


LATE_DEVICE = textwrap.dedent("""
    import sys, time
    from attncheck import env
    env.configure()
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    def late(x):  # the first device reaches the psum 4 s after the second
        if float(x[0]) == 0.0:
            time.sleep(4)
        return x

    def step(x):
        return jax.lax.psum(jax.pure_callback(late, jax.ShapeDtypeStruct(x.shape, x.dtype), x), "d")

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    print(jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(jnp.arange(2.0)))
""")


def test_a_device_late_at_a_collective_is_waited_for_not_aborted():
    """XLA aborts the process when a device reaches a collective more than its stuck-warning
    and termination timeouts after another (20 + 40 s by default; here the caller asks for
    1 + 1, and the device is 4 s late): interpreted kernels on a loaded runner can be that
    late without any deadlock. A run waits (a deadlock is
    the watchdog's to end, with every thread's stack)."""
    caller = {**os.environ, "PYTHONPATH": _REPO,
              "XLA_FLAGS": "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1 "
                           "--xla_cpu_collective_call_terminate_timeout_seconds=1"}
    proc = subprocess.run([sys.executable, "-c", LATE_DEVICE], env=caller, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "[1. 1.]" in proc.stdout, proc.stderr[-2000:]
