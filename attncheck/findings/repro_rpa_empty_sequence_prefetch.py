"""Ragged paged attention: a sequence with q_len == kv_len == 0 makes the NEXT sequence
attend to the empty sequence's page instead of its own.

The kernel double-buffers KV blocks: while it computes one block it has already started the
DMA for the next (sequence, kv block), and the first block of sequence 0 is started before
the loop. For a sequence with kv_len == 0 the kv-block while_loop runs zero times, so the
DMA already in flight for that sequence (its page_indices[i, 0], because
MultiPageAsyncCopyDescriptor maps page_idx >= end_page_idx to 0) is never waited for and
nothing is started for the following sequence. The following sequence then waits on the
same buffer/semaphore with its own descriptor and computes with the empty sequence's page.
If the empty sequence's page_indices row holds padding (e.g. a page id >= total_num_pages),
the stray DMA reads out of bounds. dynamic_validate_inputs accepts the input.

Here: 2 sequences, (q_len, kv_len) = (0, 0) and (1, 8); page 0 belongs to sequence 0,
page 1 to sequence 1. Sequence 1's output equals attention over page 0.

Run:  python findings/repro_rpa_empty_sequence_prefetch.py
(CPU only, Pallas TPU interpret mode; exits 1 with an AssertionError while the bug is present.)

Note: jax 0.12's TPU interpreter cannot load through a reshaped ref (the kernel does
`kv_bufs.at[buf].reshape(...)[start::step, :]`; the interpreter's `get` raises
"AttributeError: 'ReshapeTransform' object has no attribute 'indices'"). The small
`_load_through_reshape` shim below performs exactly that load in NumPy (read the whole
buffer, reshape, index) and changes nothing else; it is not involved in the bug (DMA
issue/wait order).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jaxlib
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import dynamic_validate_inputs
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, backend {jax.default_backend()}")


# ---- interpreter shim: loads through a reshaped ref (interpreter limitation in jax 0.12) ----
def _install_reshape_load_shim():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax._src.state import indexing, types as state_types

    original_get = ipc.get.__wrapped__

    def _load_through_reshape(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kw):
        transforms = tuple(jax.tree.map(int, transforms))
        cut = next((n for n, t in enumerate(transforms) if isinstance(t, state_types.ReshapeTransform)), None)
        if cut is None:
            return original_get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kw)
        token, value = original_get(token, device_id, local_core_id, memory_space, buffer_id, transforms[:cut],
                                    *args, **kw)
        value = np.asarray(value)
        for t in transforms[cut:]:
            if isinstance(t, state_types.ReshapeTransform):
                value = value.reshape(t.shape)
            else:
                value = value[tuple(slice(i.start, i.start + i.size * i.stride, i.stride)
                                    if isinstance(i, indexing.Slice) else i for i in t.indices)]
        return token, value

    ipc.get = ipc.fail_on_exception(_load_through_reshape)


_install_reshape_load_shim()
# ---------------------------------------------------------------------------------------------

PAGE_SIZE, HEAD_DIM = 8, 128
rng = np.random.default_rng(0)
# kv_pages: [total_num_pages, page_size, num_combined_kv_heads (K, V interleaved), head_dim]
kv_pages = rng.standard_normal((2, PAGE_SIZE, 2, HEAD_DIM)).astype(np.float32)
q = rng.standard_normal((1, 1, HEAD_DIM)).astype(np.float32)  # [tokens, q_heads, head_dim]
kv_lens = np.array([0, PAGE_SIZE], np.int32)  # sequence 0 is empty
page_indices = np.array([[0], [1]], np.int32)  # sequence 0 -> page 0, sequence 1 -> page 1
cu_q_lens = np.array([0, 0, 1], np.int32)  # q_len 0 and 1
num_seqs = np.array([2], np.int32)

dynamic_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
print("dynamic_validate_inputs accepted the input")

with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    out = ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                 num_kv_pages_per_block=1, num_queries_per_block=1)
got = np.asarray(out)[0, 0].astype(np.float64)  # the only query token: sequence 1's


def attention_over_page(page):  # float64, sm_scale 1.0, decode token sees all 8 keys
    keys = kv_pages[page, :, 0].astype(np.float64)
    values = kv_pages[page, :, 1].astype(np.float64)
    s = keys @ q[0, 0].astype(np.float64)
    p = np.exp(s - s.max())
    return (p / p.sum()) @ values


ref = attention_over_page(1)  # sequence 1's own page
wrong = attention_over_page(0)  # the empty sequence's page
err = np.where(np.isnan(got), np.inf, np.abs(got - ref))
i = int(np.argmax(err))
print(f"sequence 1 (token 0), worst element (0, 0, {i}): kernel {got[i]:.9g}, reference {ref[i]:.9g}")
print(f"max |kernel - attention over the EMPTY sequence's page 0| = {np.abs(got - wrong).max():.3g}")
assert err[i] <= 1e-4, (f"ragged_paged_attention: the sequence after an empty one (q_len = kv_len = 0) is wrong "
                        f"(max |diff| {err[i]:.3g}); it attended to the empty sequence's page")
print("OK: sequence 1 matches the float64 reference")
