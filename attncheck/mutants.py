"""The mutant catalogue: known kernel bugs the gate must catch (see attncheck.mutation)."""

from __future__ import annotations

from attncheck.mutation import Mutant

FFN = "kernels/blockwise_ffn.py"

CATALOGUE: list[Mutant] = [
    Mutant("ffn-chunk-output-order", "blockwise_ffn", FFN,
           find="    out = jnp.moveaxis(out, 0, -3)\n",
           replace="    out = jnp.moveaxis(jnp.flip(out, 0), 0, -3)\n",
           description="chunks written back in reverse order", bug_class="index_map_wrong_block",
           sample=True),
]
