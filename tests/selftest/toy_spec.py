"""A tiny, fast kernel family for the self-tests of the harness (plugin, records, merge,
reports, CLI): ``toy_attention(q, k, v, *, causal, sm_scale)`` on [B, H, S, D], pure jnp,
backend ``xla`` only, with a few deliberately broken implementations.

Load it into a gate run with ``--attncheck-spec tests.selftest.toy_spec --attncheck-only-spec``
and swap the implementation with
``--attncheck-impl toy_attention=tests.selftest.toy_spec:toy_attention_wrong_scale``.

Semantics mapped onto the oracle: logits = sm_scale * q.k, causal top-left (key j visible
to query i iff j <= i); q and kv have the same length, so no row is ever fully masked.

Implementations (all with the family's calling convention):
- ``toy_attention``: the reference implementation (default impl ``builtin``);
- ``toy_attention_lse``: a second correct formulation, exp(logits - logsumexp) (impl ``lse``);
- ``toy_attention_chunked``: a third, online softmax over two key chunks (impl ``chunked``);
- ``toy_attention_wrong_scale``: applies sm_scale twice (the gate must FAIL it);
- ``toy_attention_mixed``: wrong on causal cases only: a run yields pass records, then the
  fail records of the first causal case;
- ``toy_attention_crash``: raises ValueError (error records);
- ``toy_attention_interrupt``: raises KeyboardInterrupt on its INTERRUPT_AT-th call (it runs
  eagerly, so its N-th call is the N-th case);
- ``toy_attention_hang``: never returns (for the per-test timeout).

If ``ATTNCHECK_TOY_CALL_LOG`` names a file, every executed case appends one line
"<pid> <impl_ref> <case_id>" to it: an independent count of the comparisons a run made.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from attncheck import baseline, oracle
from attncheck import strategies as S
from attncheck.specs.base import Case, InvalidCall, KernelSpec, make_case

FAMILY = "toy_attention"
SEQ_LENS = (8, 16)
HEAD_DIM = 4
# Not 1.0: applying the scale twice must change the result of every case.
SM_SCALE = 1.0 / HEAD_DIM**0.5
BATCH, HEADS = 2, 2  # fixed: few shapes, so few compiles (the self-tests run the gate often)
DIRECTIONS = ("out", "dq", "dk", "dv")
CALL_LOG_ENV = "ATTNCHECK_TOY_CALL_LOG"
INTERRUPT_AT = 3
_MASKED_LOGIT = -1e30


# ---------------------------------------------------------------------- implementations
def _validate(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, heads, seq, head_dim], got shape {x.shape}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"k and v must have the shape of q {q.shape} (same heads, seq and head dim), "
                         f"got k {k.shape}, v {v.shape}")


def _logits(q, k, causal, sm_scale):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    if causal:
        n = q.shape[2]
        s = jnp.where(jnp.tril(jnp.ones((n, n), dtype=bool)), s, _MASKED_LOGIT)
    return s


def _weighted(p, v, dtype):
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(dtype)


def toy_attention(q, k, v, *, causal: bool, sm_scale: float):
    _validate(q, k, v)
    return _weighted(jax.nn.softmax(_logits(q, k, causal, sm_scale), axis=-1), v, q.dtype)


def toy_attention_lse(q, k, v, *, causal: bool, sm_scale: float):
    _validate(q, k, v)
    s = _logits(q, k, causal, sm_scale)
    return _weighted(jnp.exp(s - jax.nn.logsumexp(s, axis=-1, keepdims=True)), v, q.dtype)


def toy_attention_chunked(q, k, v, *, causal: bool, sm_scale: float):
    """Online softmax over two key chunks (the flash-attention recurrence, in jnp)."""
    _validate(q, k, v)
    s = _logits(q, k, causal, sm_scale)
    half = s.shape[-1] // 2
    acc = denom = m = None
    for lo, hi in ((0, half), (half, s.shape[-1])):
        s_c, v_c = s[..., lo:hi], v[:, :, lo:hi].astype(jnp.float32)
        m_c = jnp.max(s_c, axis=-1, keepdims=True)
        m_new = m_c if m is None else jnp.maximum(m, m_c)
        p = jnp.exp(s_c - m_new)
        pv, p_sum = jnp.einsum("bhqk,bhkd->bhqd", p, v_c), jnp.sum(p, axis=-1, keepdims=True)
        if acc is None:
            acc, denom = pv, p_sum
        else:
            alpha = jnp.exp(m - m_new)
            acc, denom = acc * alpha + pv, denom * alpha + p_sum
        m = m_new
    return (acc / denom).astype(q.dtype)


def toy_attention_wrong_scale(q, k, v, *, causal: bool, sm_scale: float):
    """The planted bug: the scale is applied to q and again to the logits."""
    return toy_attention(q * sm_scale, k, v, causal=causal, sm_scale=sm_scale)


def toy_attention_mixed(q, k, v, *, causal: bool, sm_scale: float):
    if causal:
        return toy_attention_wrong_scale(q, k, v, causal=causal, sm_scale=sm_scale)
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)


def toy_attention_crash(q, k, v, *, causal: bool, sm_scale: float):
    raise ValueError("toy: planted crash <script>alert(1)</script>")


_calls = {"interrupt": 0}


def toy_attention_interrupt(q, k, v, *, causal: bool, sm_scale: float):
    _calls["interrupt"] += 1
    if _calls["interrupt"] >= INTERRUPT_AT:
        raise KeyboardInterrupt(f"toy: interrupted on call {_calls['interrupt']}")
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)


toy_attention_interrupt.toy_eager = True  # called (not traced once per shape) for every case


def toy_attention_hang(q, k, v, *, causal: bool, sm_scale: float):
    while True:  # a kernel that never returns: only the per-test timeout ends it
        time.sleep(0.05)


# ---------------------------------------------------------------------- the spec
@st.composite
def toy_cases(draw) -> Case:
    return make_case(FAMILY, draw(S.seeds), dtype=draw(st.sampled_from(tuple(S.DTYPES))), batch=BATCH,
                     heads=HEADS, seq_len=draw(st.sampled_from(SEQ_LENS)), head_dim=HEAD_DIM,
                     causal=draw(st.booleans()), sm_scale=SM_SCALE)


def _log_call(impl, case: Case) -> None:
    path = os.environ.get(CALL_LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:  # one short O_APPEND write per case
            fh.write(f"{os.getpid()} {impl.__module__}:{impl.__qualname__} {case.id}\n")


def _forward_and_grads(forward, q, k, v, d_out):
    out, vjp = jax.vjp(forward, q, k, v)
    return (out, *vjp(d_out.astype(out.dtype)))


# One compiled fwd+vjp per implementation and static configuration.
_JITTED: dict = {}


class ToySpec(KernelSpec):
    name = FAMILY
    # Three implementations: with the two invalid-call tests, xdist's initial chunks of two
    # tests put gate tests on two workers, so a -n 2 merge really joins several files.
    default_impls = {"builtin": "tests.selftest.toy_spec:toy_attention",
                     "lse": "tests.selftest.toy_spec:toy_attention_lse",
                     "chunked": "tests.selftest.toy_spec:toy_attention_chunked"}
    backends = ("xla",)
    coverage_classes = ("causal", "bf16")
    examples = {"xla": 4}

    def cases(self):
        return toy_cases()

    def inputs(self, case: Case) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(case.seed)
        dt = S.dtype_of(case["dtype"])
        shape = (case["batch"], case["heads"], case["seq_len"], case["head_dim"])
        return {name: S.round_to(rng.standard_normal(shape), dt) for name in ("q", "k", "v", "d_out")}

    def _forward(self, impl, case):
        return functools.partial(impl, causal=case["causal"], sm_scale=case["sm_scale"])

    def run(self, impl, case, inputs):
        _log_call(impl, case)
        operands = [inputs[n] for n in ("q", "k", "v", "d_out")]
        if getattr(impl, "toy_eager", False):  # really call the implementation for every case
            results = _forward_and_grads(self._forward(impl, case), *operands)
        else:
            key = (impl.__module__, impl.__qualname__, case["dtype"], case["batch"], case["heads"],
                   case["seq_len"], case["head_dim"], case["causal"], case["sm_scale"])
            fn = _JITTED.get(key)
            if fn is None:
                fn = _JITTED[key] = jax.jit(functools.partial(_forward_and_grads, self._forward(impl, case)))
            results = fn(*operands)
        return {n: np.asarray(x) for n, x in zip(DIRECTIONS, results)}

    def lower(self, impl, case):
        forward = self._forward(impl, case)
        shape = (case["batch"], case["heads"], case["seq_len"], case["head_dim"])
        struct = jax.ShapeDtypeStruct(shape, S.dtype_of(case["dtype"]))

        def export(fn, n):
            return lambda: jax.export.export(jax.jit(fn), platforms=["tpu"])(*[struct] * n)

        return {"lower-fwd": export(forward, 3),
                "lower-grad": export(functools.partial(_forward_and_grads, forward), 4)}

    def oracle(self, case, inputs):
        args = (inputs["q"], inputs["k"], inputs["v"])
        sem = dict(scale=case["sm_scale"], causal=case["causal"], masked_rows="zero")
        grads = oracle.attention_vjp(*args, inputs["d_out"], **sem)
        return {"out": oracle.attention(*args, **sem).out, "dq": grads["dq"], "dk": grads["dk"], "dv": grads["dv"]}

    def baseline(self, case, inputs):
        positions = np.arange(case["seq_len"])
        visible = baseline.visibility(positions, positions, causal=case["causal"])
        return baseline.attention_with_grads(inputs["q"], inputs["k"], inputs["v"], inputs["d_out"],
                                             scale=case["sm_scale"], visible=visible, masked_rows="zero")

    def output_dtypes(self, case):
        return {d: S.dtype_of(case["dtype"]) for d in DIRECTIONS}

    def classes(self, case):
        return [tag for tag, on in (("bf16", case["dtype"] == "bfloat16"), ("causal", case["causal"])) if on]

    def index_names(self, direction):
        return {"out": ("batch", "head", "query", "dim"), "dq": ("batch", "head", "query", "dim"),
                "dk": ("batch", "head", "key", "dim"), "dv": ("batch", "head", "key", "dim")}.get(direction)

    def invalid_calls(self):
        return invalid_toy_calls()


def invalid_toy_calls() -> list[InvalidCall]:
    q = jnp.zeros((1, 1, 8, HEAD_DIM), jnp.float32)
    k = jnp.zeros((1, 1, 8, 2 * HEAD_DIM), jnp.float32)
    return [InvalidCall("rank", lambda: toy_attention(q[0], q[0], q[0], causal=False, sm_scale=1.0),
                        ValueError, r"\bq\b must have rank 4"),
            InvalidCall("kv_head_dim", lambda: toy_attention(q, k, k, causal=False, sm_scale=1.0),
                        ValueError, r"\bk\b and v must have the shape of q")]


SPEC = ToySpec()


# ---------------------------------------------------------------------- self-test harness
# Runs the project's own gate test module (tests/gate) on the toy family in a pytester
# directory, in a subprocess (xdist needs one).
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
GATE_FILES = ("tests/gate/test_gate.py", "tests/gate/conftest.py")
SPEC_MODULE = "tests.selftest.toy_spec"
GATE_ARGS = ("-p", "no:randomly", "--hypothesis-profile=ci", f"--attncheck-spec={SPEC_MODULE}",
             "--attncheck-only-spec")
# Shared by every toy run: the second run of a shape skips XLA's compile.
JAX_CACHE = REPO_ROOT / ".jax_cache" / "selftest-toy"
RUN_TIMEOUT_S = 240
INI = """[pytest]
timeout_method = signal
markers =
    gate: the pull-request gate
"""


def impl_option(name: str) -> str:
    return f"--attncheck-impl=toy_attention={SPEC_MODULE}:{name}"


def setup_gate_dir(pytester, monkeypatch) -> pathlib.Path:
    """Copy the gate test module (read now, so it stays in sync) and point the environment
    of the runs at the repository and the toy spec."""
    for rel in GATE_FILES:
        (pytester.path / pathlib.Path(rel).name).write_text((REPO_ROOT / rel).read_text())
    pytester.makeini(INI)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(JAX_CACHE))
    # The runs must not write to this job's step summary, nor think they are xdist workers.
    for name in ("GITHUB_STEP_SUMMARY", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                 "PYTEST_XDIST_TESTRUNUID", CALL_LOG_ENV):
        monkeypatch.delenv(name, raising=False)
    return pytester.path


def run_gate(pytester, report: str, *args: str):
    """The gate on the toy family, in a subprocess; -n 0 unless args say otherwise."""
    extra = () if any(a.startswith("-n") for a in args) else ("-n", "0")
    return pytester.runpytest_subprocess(*GATE_ARGS, f"--attncheck-report={report}", *extra, *args,
                                         timeout=RUN_TIMEOUT_S)


def start_gate(directory: pathlib.Path, report: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Like run_gate but started in the background (for concurrent runs); cwd = directory."""
    return subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *GATE_ARGS,
                             f"--attncheck-report={report}", *args],
                            cwd=directory, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def cli(directory: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m attncheck ARGS`` with cwd = directory."""
    return subprocess.run([sys.executable, "-m", "attncheck", *args], cwd=directory, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)


def load_report(directory: pathlib.Path) -> dict:
    return json.loads((directory / "report.json").read_text())


def load_schema() -> dict:
    return json.loads((REPO_ROOT / "attncheck" / "report" / "schema.json").read_text())
