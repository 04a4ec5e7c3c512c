"""A tiny, fast kernel family for the self-tests of the harness (plugin, records, merge,
reports, CLI): ``toy_attention(q, k, v, *, causal, sm_scale)`` on [B, H, S, D], pure jnp,
backend ``xla`` only, with a few deliberately broken implementations.

Load it into a gate run with ``--attncheck-spec tests.selftest.toy_spec --attncheck-only-spec``
and swap the implementation with
``--attncheck-impl toy_attention=tests.selftest.toy_spec:toy_attention_wrong_scale``
(``harness`` runs such gates for the self-tests).

Semantics mapped onto the oracle: logits = sm_scale * q.k, causal top-left (key j visible
to query i iff j <= i); q and kv have the same length, so no row is ever fully masked.

Implementations (all with the family's calling convention):
- ``toy_attention``: the reference implementation (default impl ``builtin``);
- ``toy_attention_lse``: a second correct formulation, exp(logits - logsumexp) (impl ``lse``);
- ``toy_attention_chunked``: a third, online softmax over two key chunks (impl ``chunked``);
- ``toy_attention_wrong_scale``: applies sm_scale twice (the gate must FAIL it);
- ``toy_attention_chunk_edge``: never attends to the key at the boundary of the two key
  chunks (a planted block-edge bug: its error map lights up at the chunk boundary);
- ``toy_attention_mixed``: wrong on causal cases only: a run yields pass records, then the
  fail records of the first causal case;
- ``toy_attention_new_keyword``: correct, with a keyword the spec never passes;
- ``toy_attention_crash``: raises ValueError (error records);
- ``toy_attention_interrupt``: raises KeyboardInterrupt on its INTERRUPT_AT-th call with valid
  inputs (it runs eagerly, so its N-th such call is the N-th case);
- ``toy_attention_hang``: never returns (for the per-test timeout).

The last two reject invalid inputs as the convention requires (the gate's invalid-input
tests call every implementation under test) and misbehave only on valid ones.

If ``ATTNCHECK_TOY_CALL_LOG`` names a file, every executed case appends one line
"<pid> <impl_ref> <case_id>" to it: an independent count of the comparisons a run made.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from attncheck import backends, bugclasses, oracle, yardstick
from attncheck import strategies as S
from attncheck.cases import Case, Params
from attncheck.compiled import compiled, impl_key, with_vjp
from attncheck.layouts import ErrorMapLayout, every
from attncheck.specs.base import InvalidCall, KernelSpec

FAMILY = "toy_attention"
SEQ_LENS = (8, 16)
HEAD_DIM = 4
# Not 1.0: applying the scale twice must change the result of every case.
SM_SCALE = 1.0 / HEAD_DIM**0.5
BATCH, HEADS = 2, 2  # fixed: few shapes, so few compiles (the self-tests run the gate often)
CALL_LOG_ENV = "ATTNCHECK_TOY_CALL_LOG"
INTERRUPT_AT = 3
_MASKED_LOGIT = -1e30


# ---------------------------------------------------------------------- implementations
def validate(q, k, v):
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
    validate(q, k, v)
    return _weighted(jax.nn.softmax(_logits(q, k, causal, sm_scale), axis=-1), v, q.dtype)


def toy_attention_lse(q, k, v, *, causal: bool, sm_scale: float):
    validate(q, k, v)
    s = _logits(q, k, causal, sm_scale)
    return _weighted(jnp.exp(s - jax.nn.logsumexp(s, axis=-1, keepdims=True)), v, q.dtype)


def toy_attention_chunked(q, k, v, *, causal: bool, sm_scale: float):
    """Online softmax over two key chunks (the flash-attention recurrence, in jnp)."""
    validate(q, k, v)
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


def toy_attention_chunk_edge(q, k, v, *, causal: bool, sm_scale: float):
    """The second key chunk starts one key late, so the key at the chunk boundary is never
    attended to (an off-by-one in a block's start offset)."""
    validate(q, k, v)
    s = _logits(q, k, causal, sm_scale)
    return _weighted(jax.nn.softmax(s.at[..., s.shape[-1] // 2].set(_MASKED_LOGIT), axis=-1), v, q.dtype)


def toy_attention_wrong_scale(q, k, v, *, causal: bool, sm_scale: float):
    """The planted bug: the scale is applied to q and again to the logits."""
    return toy_attention(q * sm_scale, k, v, causal=causal, sm_scale=sm_scale)


def toy_attention_mixed(q, k, v, *, causal: bool, sm_scale: float):
    if causal:
        return toy_attention_wrong_scale(q, k, v, causal=causal, sm_scale=sm_scale)
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)


def toy_attention_new_keyword(q, k, v, *, causal: bool, sm_scale: float, window: int | None = None):
    """A correct implementation that grew a keyword the family's spec never passes: the
    parameter-coverage check must call it out (it always kept its default)."""
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)


def toy_attention_crash(q, k, v, *, causal: bool, sm_scale: float):
    raise ValueError("toy: planted crash <script>alert(1)</script>")


_calls = {"interrupt": 0}


def toy_attention_interrupt(q, k, v, *, causal: bool, sm_scale: float):
    validate(q, k, v)
    _calls["interrupt"] += 1
    if _calls["interrupt"] >= INTERRUPT_AT:
        raise KeyboardInterrupt(f"toy: interrupted on call {_calls['interrupt']}")
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)


toy_attention_interrupt.toy_eager = True  # called (not traced once per shape) for every case


def toy_attention_hang(q, k, v, *, causal: bool, sm_scale: float):
    validate(q, k, v)
    while True:  # a kernel that never returns: only the per-test timeout ends it
        time.sleep(0.05)


# ---------------------------------------------------------------------- the spec
@dataclasses.dataclass(frozen=True)
class ToyParams(Params):
    dtype: str
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    causal: bool
    sm_scale: float

    @property
    def sequence_length(self) -> int:
        return self.seq_len

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.heads, self.seq_len, self.head_dim


@st.composite
def toy_cases(draw, family: str = FAMILY) -> Case[ToyParams]:
    seed = draw(S.seeds)
    return Case(family, ToyParams(dtype=draw(st.sampled_from(tuple(S.DTYPES))), batch=BATCH, heads=HEADS,
                                  seq_len=draw(st.sampled_from(SEQ_LENS)), head_dim=HEAD_DIM,
                                  causal=draw(st.booleans()), sm_scale=SM_SCALE), seed)


def _log_call(impl, case: Case) -> None:
    path = os.environ.get(CALL_LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:  # one short O_APPEND write per case
            fh.write(f"{os.getpid()} {impl.__module__}:{impl.__qualname__} {case.id}\n")


class ToySpec(KernelSpec[ToyParams]):
    name = FAMILY
    # Three implementations: with their invalid-call tests, xdist's initial chunks of two
    # tests put gate tests on two workers, so a -n 2 merge really joins several files.
    default_impls = {"builtin": "tests.selftest.toy_spec:toy_attention",
                     "lse": "tests.selftest.toy_spec:toy_attention_lse",
                     "chunked": "tests.selftest.toy_spec:toy_attention_chunked"}
    params_type = ToyParams
    directions = {"out": ("batch", "head", "query", "dim"), "dq": ("batch", "head", "query", "dim"),
                  "dk": ("batch", "head", "key", "dim"), "dv": ("batch", "head", "key", "dim")}
    backends = ("xla",)
    bug_classes = bugclasses.bug_classes(causal=lambda p: p.causal, bf16=lambda p: p.dtype == "bfloat16")
    examples = {"xla": 4}
    # Few shapes, so that the self-tests, which run this gate often, compile little.
    fixed_parameters = {**{f"*.shape[{axis}]": "the toy family keeps batch, heads and head_dim fixed: few compiles"
                           for axis in (0, 1, 3)},
                        "sm_scale": "the toy family's scale is fixed (applying it twice must change every case)"}

    def cases(self):
        return toy_cases(self.name)

    def inputs(self, case):
        rng = np.random.default_rng(case.seed)
        dt = S.dtype_of(case.params.dtype)
        return {name: S.round_to(rng.standard_normal(case.params.shape), dt) for name in ("q", "k", "v", "d_out")}

    @staticmethod
    def _forward(impl, p: ToyParams):
        return functools.partial(impl, causal=p.causal, sm_scale=p.sm_scale)

    def evaluate(self, impl, case, inputs):
        _log_call(impl, case)
        primals = [inputs[n] for n in ("q", "k", "v")]
        forward_and_vjp = with_vjp(self._forward(impl, case.params))
        if not getattr(impl, "toy_eager", False):  # eager: really call the implementation for every case
            forward_and_vjp = compiled(("toy", impl_key(impl), case.params), lambda f=forward_and_vjp: f)
        out, grads = forward_and_vjp(primals, inputs["d_out"])
        return {n: np.asarray(x) for n, x in zip(self.directions, (out, *grads))}

    def lower(self, impl, case):
        struct = jax.ShapeDtypeStruct(case.params.shape, S.dtype_of(case.params.dtype))
        return backends.tpu_exports(self._forward(impl, case.params), [struct] * 3, struct, device_kind=None)

    def oracle(self, case, inputs):
        p = case.params
        args = (inputs["q"], inputs["k"], inputs["v"])
        sem = dict(scale=p.sm_scale, causal=p.causal, masked_rows="zero")
        grads = oracle.attention_vjp(*args, inputs["d_out"], **sem)
        return {"out": oracle.attention(*args, **sem).out, "dq": grads["dq"], "dk": grads["dk"], "dv": grads["dv"]}

    def yardstick(self, case, inputs):
        p = case.params
        positions = np.arange(p.seq_len)
        visible = yardstick.visibility(positions, positions, causal=p.causal)
        return yardstick.attention_with_grads(inputs["q"], inputs["k"], inputs["v"], inputs["d_out"],
                                              scale=p.sm_scale, visible=visible, masked_rows="zero")

    def error_map_layout(self, case, direction):
        # The chunked implementation's two key chunks, on the key axis of dk and dv.
        p = case.params
        keys = (every("key chunk", p.seq_len // 2, p.seq_len),) if direction in ("dk", "dv") else ()
        return ErrorMapLayout(self.index_names(direction), 2, 3, keys)

    def invalid_calls(self, impl):
        return invalid_toy_calls(impl)


def invalid_toy_calls(impl) -> list[InvalidCall]:
    q = jnp.zeros((1, 1, 8, HEAD_DIM), jnp.float32)
    k = jnp.zeros((1, 1, 8, 2 * HEAD_DIM), jnp.float32)
    return [InvalidCall("rank", lambda: impl(q[0], q[0], q[0], causal=False, sm_scale=1.0),
                        ValueError, r"\bq\b must have rank 4"),
            InvalidCall("kv_head_dim", lambda: impl(q, k, k, causal=False, sm_scale=1.0),
                        ValueError, r"\bk\b and v must have the shape of q")]


SPEC = ToySpec()

