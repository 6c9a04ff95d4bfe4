"""Does a float32 matmul round row 0 the same whatever the number of rows beside it?

    python experiments/matmul_row_classes.py

Multiplies the first M rows of one [256, 576] matrix by a [576, 1536] weight (SmolLM2's MLP shape)
for M = 1 .. 256 and prints, for each M, which other M give bitwise the same row 0. Rows sharing a
batch in the serving engine are exactly this case: a request's numbers can depend on how many rows
its step carries. A contraction over more (zero-weighted) cache slots is checked the same way.
"""

import jax
import jax.numpy as jnp
import numpy as np


def main():
    rng = np.random.default_rng(0)
    weight = jnp.asarray(rng.standard_normal((576, 1536)).astype(np.float32))
    rows = rng.standard_normal((256, 576)).astype(np.float32)
    matmul = jax.jit(lambda x, w: x @ w)
    counts = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    first = {m: np.asarray(matmul(jnp.asarray(rows[:m]), weight))[0] for m in counts}
    print(f"backend {jax.default_backend()}; row 0 bitwise equal between row counts:")
    for m in counts:
        same = [n for n in counts if (first[m] == first[n]).all()]
        print(f"  {m:>3} rows: same as {same}")
    values = rng.standard_normal((1024, 64)).astype(np.float32)
    probs = np.zeros((1, 1024), np.float32)
    probs[0, :100] = rng.random(100)
    attend = jax.jit(lambda p, v: p @ v)
    outs = [np.asarray(attend(jnp.asarray(probs[:, :s]), jnp.asarray(values[:s]))) for s in (128, 256, 512, 1024)]
    print("attention-like contraction over 128/256/512/1024 slots (zeros past 100) equal to 128:",
          [bool((outs[0] == o).all()) for o in outs])


if __name__ == "__main__":
    main()
