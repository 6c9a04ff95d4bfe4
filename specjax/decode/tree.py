"""Draft trees: built from the drafter's per-depth marginals, verified in one target pass, lossless.

A block drafter gives one distribution per draft slot (depth). A chain keeps only the top token
per depth; a tree also keeps second choices. Nodes are kept in *pop order* of a best-first
expansion on path probability P(v) = prod of the marginals along v's path, so P never increases
along the order, every node's parent comes before it, and the first n nodes always form a tree.
That makes "how many nodes" a single number, chosen per step by the budget rule (decode/budget.py).

Verification feeds all nodes to the target at once: node v sits at position `length + depth(v)`,
in its own cache slot, and attends to the committed prefix and to its ancestors only. The target's
distribution p_v at every node then comes from one forward pass.

Acceptance is the target-first traversal, exact for any tree: draw y_v ~ p_v at every node with
independent randomness, start at the root, and while y at the current node is the token of one of
its children, descend into that child. The y at the last node is the bonus (leaf) or correction
token. Each committed token is a draw from the target's distribution given the tokens before it,
and since each node's draw is used at most once along the path, drawing them all up front in
parallel changes nothing. Greedy decoding is the same traversal with y_v = argmax p_v, so it
reproduces the target's greedy output. The tree itself may be any deterministic function of the
drafter's output; no draft probability enters the acceptance test.
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decode.budget import LatencyModel, interleaved_min_seconds, median_seconds, monotone_costs
from specjax.decode.refine import refine_drafts
from specjax.decode.sampling import SamplingConfig, processed_logits
from specjax.decode.context import empty_context_cache
from specjax.decode.speculative import RefinerInputs, draft_block_states
from specjax.errors import SpecjaxError
from specjax.models.cache import KVCache, ring_index, write_ring
from specjax.models.config import TransformerConfig
from specjax.models.drafter import DrafterConfig
from specjax.models.transformer import apply_head, forward, head_matrix, token_embedder

TREE_SHAPES = ("best-first", "fixed")
DEFAULT_BUCKETS = {"cpu": (1, 2, 4, 8, 16, 32, 64), "gpu": (16, 32, 64, 128, 256), "tpu": (16, 32, 64, 128, 256)}
"""Verify sizes compiled per backend. The budget rule still picks among them from measured costs;
these only bound what it can pick (a CPU never profits from 256-node trees, a GPU might). A
1-node tree is the root alone: a plain decode step, for when no draft pays for its verification."""


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """How draft trees are shaped and sized. Hashable: a static argument of the decode loop."""

    shape: str = "best-first"
    """"best-first": grown on path probability, sized per step by the budget rule (or to `budget`).
    "fixed": the baseline, the drafter's top-1 chain with the `width - 1` next-ranked tokens of every
    depth as extra leaves, 1 + K * width nodes."""
    buckets: tuple[int, ...] | None = None
    """Node counts (root included) the verify pass is compiled for. A step verifies the smallest
    bucket that holds the chosen tree and fills it with the next nodes in pop order, which cost
    nothing extra. Every bucket is compiled once, so sizes change per step without recompiling.
    None: DEFAULT_BUCKETS for the backend (small on CPU, where verify cost grows fast with size)."""
    budget: int | None = None
    """None: choose the size per step with the budget rule. An int: always this many nodes
    (then the only bucket)."""
    top_k: int = 16
    """Candidate tokens per depth for best-first trees. With the SmolLM2 drafter, 16-node trees
    measured tau 1.506 at 8 candidates and 1.548 at 16 or 32 (docs/notes/2026-12-03-draft-trees.md, run B)."""
    width: int = 2
    """Tokens per depth of the fixed-shape tree."""

    def __post_init__(self):
        if self.shape not in TREE_SHAPES:
            raise SpecjaxError(f"unknown tree shape {self.shape!r}; available: {', '.join(TREE_SHAPES)}")
        if self.buckets is not None and (not self.buckets or any(b < 1 for b in self.buckets)
                                         or list(self.buckets) != sorted(set(self.buckets))):
            raise SpecjaxError(f"tree buckets must be increasing positive node counts, got {self.buckets}")
        if self.budget is not None and self.budget < 1:
            raise SpecjaxError(f"a tree budget must be at least 1 node (the root), got {self.budget}")
        if self.top_k < 1 or self.width < 1:
            raise SpecjaxError(f"top_k and width must be >= 1, got {self.top_k} and {self.width}")

    def node_buckets(self, num_draft: int) -> tuple[int, ...]:
        """The verify sizes this config compiles for a drafter with num_draft draft slots."""
        if self.shape == "fixed":
            return (1 + num_draft * self.width,)
        if self.budget is not None:
            return (self.budget,)
        if self.buckets is not None:
            return self.buckets
        return DEFAULT_BUCKETS.get(jax.default_backend(), DEFAULT_BUCKETS["gpu"])

    @property
    def auto(self) -> bool:
        """Whether the budget rule picks the size each step."""
        return self.shape == "best-first" and self.budget is None

    def within_query_rows(self, num_draft: int, query_rows: int | None) -> "TreeConfig":
        """This config for a target whose decode-time forwards are padded to query_rows = W rows.
        A verify pass is exact by construction only at W rows or fewer (padded to W); larger ones
        would have shapes no AR step has, so a fixed tree larger than W is refused. An auto tree
        verifies its largest bucket up to W every step: every bucket runs the same W-row forward,
        so a smaller one saves only the work outside it, and choosing between them costs more than
        it saves. Measured in bf16 on SmolLM2 at batch 1 (W = 16; docs/notes/2026-12-06-query-rows-probe.md,
        "Trees under padded query rows"): a 16-node step took 17-22% more than a 1-node one and committed 2.07
        tokens against 1.37 for 2 nodes, and the auto tree choosing among 1..16 ran at 1.06-1.36x
        AR in six runs against the fixed 16's 1.43-1.48x. Chains are fitted the same way by
        slots.method_within_query_rows."""
        if query_rows is None:
            return self
        sizes = self.node_buckets(num_draft)
        if not self.auto:
            if sizes[-1] > query_rows:
                raise SpecjaxError(f"a {sizes[-1]}-node tree verifies more rows than the target's query_rows "
                                   f"({query_rows}); use a tree of at most {query_rows} nodes or raise --query-rows")
            return self
        return dataclasses.replace(self, buckets=(max([b for b in sizes if b <= query_rows], default=query_rows),))


@struct.dataclass
class DraftTree:
    """Nodes in pop order; node 0 is the root (the newest committed token)."""

    token: jax.Array
    """[B, N] int32."""
    parent: jax.Array
    """[B, N] int32, -1 at the root."""
    depth: jax.Array
    """[B, N] int32, 0 at the root; the draft slot the node fills."""
    log_prob: jax.Array
    """[B, N] float32: log P(v), the path's summed log marginals (0 at the root, -inf if invalid)."""
    valid: jax.Array
    """[B, N] bool: false for padding nodes (the candidates ran out)."""

    def take(self, num_nodes: int) -> "DraftTree":
        """The first num_nodes nodes, which form a tree because parents precede children."""
        return jax.tree.map(lambda a: a[:, :num_nodes], self)


def top_candidates(logits, sampling: SamplingConfig, k: int):
    """Per-depth candidates from draft logits [B, K, V']: (log-probs [B, K, k] descending, head
    indices [B, K, k]). When sampling, the marginals are the processed (temperature, top-k, top-p)
    ones, so the tree follows the distribution the target will sample."""
    if not sampling.greedy:
        logits = processed_logits(logits, sampling)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, K, V']
    k = min(k, logits.shape[-1])
    # Without the barrier XLA fuses the log-softmax over the whole draft vocabulary into each
    # consumer of the candidates (every pop of the best-first loop) and recomputes it there: about
    # 50 ms instead of 1 ms per tree for SmolLM2 on CPU. One barrier per array: XLA's SPMD
    # partitioner fails a check on a barrier over the (values, indices) tuple when the vocabulary
    # is split over devices.
    values, indices = jax.lax.top_k(log_probs, k)
    return jax.lax.optimization_barrier(values), jax.lax.optimization_barrier(indices)


def best_first_tree(root_token, cand_log_probs, cand_tokens, num_nodes: int) -> DraftTree:
    """Best-first expansion of one tree per row.

    root_token: [B]; cand_log_probs, cand_tokens: [B, K, k] per-depth candidates, best first.
    Each pop takes the frontier's most probable candidate and pushes its best child and its
    next-ranked sibling. Both are no more probable than it, so nodes come out in non-increasing
    P(v), and every tree node is reached through one of these two moves.
    """
    return jax.vmap(lambda r, lp, tk: _best_first_one_row(r, lp, tk, num_nodes))(root_token, cand_log_probs, cand_tokens)


def _best_first_one_row(root_token, cand_log_probs, cand_tokens, num_nodes: int) -> DraftTree:
    depths, k = cand_log_probs.shape  # K draft depths, k candidates each
    frontier_size = max(2 * num_nodes - 1, 1)  # pop i (i >= 1) pushes into slots 2i-1 and 2i
    neg_inf = jnp.float32(-jnp.inf)
    frontier = dict(
        parent=jnp.zeros((frontier_size,), jnp.int32),
        depth=jnp.ones((frontier_size,), jnp.int32),
        rank=jnp.zeros((frontier_size,), jnp.int32),
        log_prob=jnp.full((frontier_size,), neg_inf).at[0].set(cand_log_probs[0, 0]),
    )
    nodes = DraftTree(
        token=jnp.zeros((num_nodes,), jnp.int32).at[0].set(root_token),
        parent=jnp.full((num_nodes,), -1, jnp.int32),
        depth=jnp.zeros((num_nodes,), jnp.int32),
        log_prob=jnp.full((num_nodes,), neg_inf).at[0].set(0.0),
        valid=jnp.zeros((num_nodes,), bool).at[0].set(True),
    )

    def pop(i, carry):
        frontier, nodes = carry
        best = jnp.argmax(frontier["log_prob"])
        log_prob = frontier["log_prob"][best]
        ok = log_prob > neg_inf
        parent, depth, rank = frontier["parent"][best], frontier["depth"][best], frontier["rank"][best]
        nodes = DraftTree(
            token=nodes.token.at[i].set(cand_tokens[depth - 1, rank]),
            parent=nodes.parent.at[i].set(jnp.where(ok, parent, -1)),
            depth=nodes.depth.at[i].set(depth),
            log_prob=nodes.log_prob.at[i].set(log_prob),
            valid=nodes.valid.at[i].set(ok),
        )
        # Pushes of an invalid pop carry -inf, so they never pop.
        child_lp = jnp.where(ok & (depth < depths), log_prob + cand_log_probs[jnp.minimum(depth, depths - 1), 0], neg_inf)
        sibling_lp = jnp.where(ok & (rank + 1 < k),
                               nodes.log_prob[parent] + cand_log_probs[depth - 1, jnp.minimum(rank + 1, k - 1)], neg_inf)
        frontier = dict(
            parent=frontier["parent"].at[2 * i - 1].set(i).at[2 * i].set(parent),
            depth=frontier["depth"].at[2 * i - 1].set(depth + 1).at[2 * i].set(depth),
            rank=frontier["rank"].at[2 * i - 1].set(0).at[2 * i].set(rank + 1),
            log_prob=frontier["log_prob"].at[best].set(neg_inf).at[2 * i - 1].set(child_lp).at[2 * i].set(sibling_lp),
        )
        return frontier, nodes

    _, nodes = jax.lax.fori_loop(1, num_nodes, pop, (frontier, nodes))
    return nodes


def fixed_tree(root_token, cand_log_probs, cand_tokens, width: int) -> DraftTree:
    """The fixed-shape baseline: the top-1 chain, and at every depth the next width-1 candidates as
    leaves beside it (children of the chain's node one level up). 1 + K * width nodes, in depth order."""
    batch, depths, _ = cand_log_probs.shape
    depth = jnp.repeat(jnp.arange(1, depths + 1, dtype=jnp.int32), width)  # [K * w]
    rank = jnp.tile(jnp.arange(width, dtype=jnp.int32), depths)  # [K * w]
    # The chain node of depth d is the rank-0 node at index 1 + (d - 1) * width.
    parent = jnp.where(depth == 1, 0, 1 + (depth - 2) * width)
    chain_lp = jnp.concatenate([jnp.zeros((batch, 1)), jnp.cumsum(cand_log_probs[:, :, 0], axis=1)], axis=1)  # [B, K+1]
    log_prob = chain_lp[:, depth - 1] + cand_log_probs[:, depth - 1, rank]  # [B, K * w]
    cat = lambda root, rest: jnp.concatenate([root, rest], axis=1)
    return DraftTree(
        token=cat(root_token[:, None], cand_tokens[:, depth - 1, rank]),
        parent=cat(jnp.full((batch, 1), -1, jnp.int32), jnp.broadcast_to(parent, (batch, depths * width))),
        depth=cat(jnp.zeros((batch, 1), jnp.int32), jnp.broadcast_to(depth, (batch, depths * width))),
        log_prob=cat(jnp.zeros((batch, 1)), log_prob),
        valid=cat(jnp.ones((batch, 1), bool), log_prob > -jnp.inf),
    )


def ancestor_mask(tree: DraftTree, max_depth: int | None = None) -> jax.Array:
    """[B, N, N] bool: query node v may attend to key node u iff u is v itself or an ancestor of v.
    Invalid nodes see only themselves, so they never disturb valid ones. max_depth bounds the
    nodes' depth (the drafter's K); without it, N - 1."""
    batch, num_nodes = tree.parent.shape
    node = jnp.broadcast_to(jnp.arange(num_nodes, dtype=jnp.int32), (batch, num_nodes))
    mask = jnp.zeros((batch, num_nodes, num_nodes), bool)
    current = node
    # max_depth steps up reach the root from any node; one more marks it.
    steps = num_nodes if max_depth is None else min(num_nodes, max_depth + 1)
    for _ in range(steps):
        mask = mask | ((node[:, None, :] == current[:, :, None]) & (current >= 0)[:, :, None])
        current = jnp.where(current >= 0, jnp.take_along_axis(tree.parent, jnp.maximum(current, 0), axis=1), -1)
    # An invalid node's parent chain is meaningless; give it only itself.
    return jnp.where(tree.valid[:, :, None], mask, jnp.eye(num_nodes, dtype=bool)[None])


def accept_tree(tree: DraftTree, target_logits, sampling: SamplingConfig, rng, max_depth: int):
    """Target-first traversal (module docstring). target_logits: [B, N, V] at every node.

    Returns (n_accepted [B], next_token [B], path [B, max_depth + 1]): path[:, j] is the node at
    depth j of the accepted path for j <= n, then repeats the last accepted node.
    """
    if sampling.greedy:
        drawn = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N]
    else:
        drawn = jax.random.categorical(rng, processed_logits(target_logits, sampling), axis=-1).astype(jnp.int32)
    return accept_tree_draws(tree, drawn, max_depth)


def accept_tree_draws(tree: DraftTree, drawn, max_depth: int):
    """The traversal given the target's draw y_v at every node, drawn [B, N] (independent draws, or
    the argmax when greedy). Returns what accept_tree does."""
    batch, num_nodes = tree.token.shape
    node = jnp.arange(num_nodes, dtype=jnp.int32)
    is_child = (tree.parent[:, None, :] == node[None, :, None]) & tree.valid[:, None, :]  # [B, v, c]
    # Siblings carry distinct tokens, so at most one child matches.
    matches = is_child & (tree.token[:, None, :] == drawn[:, :, None])  # [B, v, c]
    next_node = jnp.where(jnp.any(matches, axis=-1), jnp.argmax(matches, axis=-1), -1).astype(jnp.int32)  # [B, N]

    current = jnp.zeros((batch,), jnp.int32)
    accepted = jnp.zeros((batch,), jnp.int32)
    path = [current]
    for _ in range(max_depth):
        step = jnp.take_along_axis(next_node, current[:, None], axis=1)[:, 0]
        moved = step >= 0
        current = jnp.where(moved, step, current)
        accepted = accepted + moved
        path.append(current)
    next_token = jnp.take_along_axis(drawn, current[:, None], axis=1)[:, 0]
    return accepted, next_token, jnp.stack(path, axis=1)


# ---------------------------------------------------------------------------------------------
# The decode loop
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# The pieces the slot step (decode/slots.py) runs
# ---------------------------------------------------------------------------------------------

def draft_marginals(target_params, target_config: TransformerConfig, drafter_params, drafter_config: DrafterConfig,
                    last_token, lengths, context_cache: KVCache, head, draft_vocab, refiner: RefinerInputs | None,
                    context_from=None):
    """Per-depth draft logits [B, K, V'] for tree building, and refinement passes run []. With a
    refiner, the marginals are the refined ones along the refiner's own greedy chain. context_from:
    see `draft_block_states`."""
    hidden = draft_block_states(target_params, target_config, drafter_params, drafter_config, last_token, lengths,
                                context_cache, context_from=context_from)  # [B, K, d]
    logits = apply_head(hidden, head)  # [B, K, V']
    if refiner is None:
        return logits, jnp.int32(0)
    to_token = (lambda i: i) if draft_vocab is None else (lambda i: jnp.take(draft_vocab, i))
    embed = token_embedder(target_params, target_config)  # one table cast for every pass (see token_embedder)
    embed_index = lambda i: embed(to_token(i))
    anchor_embed = embed(last_token)  # [B, d]
    greedy_draft = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    _, refined, passes = refine_drafts(refiner.params, refiner.config, refiner.refine, hidden, logits, anchor_embed,
                                       greedy_draft, embed_index, refiner.low_rank_head, SamplingConfig(),
                                       jax.random.key(0))
    return refined, passes


def build_tree(last_token, draft_logits, draft_vocab, tree: TreeConfig, sampling: SamplingConfig, max_nodes: int):
    """The step's tree, max_nodes nodes in pop order (best-first) or the fixed shape."""
    k = tree.width if tree.shape == "fixed" else tree.top_k
    cand_log_probs, cand_index = top_candidates(draft_logits, sampling, k)  # [B, K, k]
    cand_tokens = cand_index if draft_vocab is None else jnp.take(draft_vocab, cand_index)
    if tree.shape == "fixed":
        return fixed_tree(last_token, cand_log_probs, cand_tokens, tree.width)
    return best_first_tree(last_token, cand_log_probs, cand_tokens, max_nodes)


def verify_tree(target_params, target_config: TransformerConfig, tree: DraftTree, lengths, target_cache: KVCache,
                taps, sampling: SamplingConfig, rng, max_depth: int, draw=None, attend_slots: int | None = None):
    """One target pass over every node, then acceptance and cache compaction.

    draw, if given, replaces drawing from `sampling` and `rng`: target logits [B, N, V] -> the draw
    at every node [B, N] (the slot step's per-row sampling). attend_slots: as in `forward`.

    Returns (n [B], next_token [B], accepted_drafts [B, max_depth], target_cache, path_features
    [B, max_depth + 1, taps, d]). The accepted path's K/V entries are moved to slots
    lengths .. lengths + n, where the next step expects them; everything past is invisible garbage."""
    positions = lengths[:, None] + tree.depth  # [B, N]
    out = forward(target_params, target_config, tree.token, positions, target_cache, lengths,
                  block_mask=ancestor_mask(tree, max_depth), hidden_layers=taps,
                  attend_slots=attend_slots, pack_visible=True)  # logits [B, N, V], hidden [B, N, taps, d]
    if draw is None:
        n, next_token, path = accept_tree(tree, out.logits, sampling, rng, max_depth)  # path [B, K+1]
    else:
        n, next_token, path = accept_tree_draws(tree, draw(out.logits), max_depth)
    accepted_drafts = jnp.take_along_axis(tree.token, path[:, 1:], axis=1)  # [B, K]
    source_slots = lengths[:, None] + path  # [B, K+1]

    def compact(layer_cache):  # [B, S, Kh, D], or a sliding layer's ring [B, R, Kh, D]
        index = ring_index(source_slots, layer_cache.shape[1])  # [B, K+1]
        moved = jnp.take_along_axis(layer_cache, index[:, :, None, None], axis=1)  # [B, K+1, Kh, D]
        return write_ring(layer_cache, moved, lengths)

    cache = KVCache(tuple(compact(k) for k in out.cache.keys), tuple(compact(v) for v in out.cache.values))
    path_features = jnp.take_along_axis(out.hidden, path[:, :, None, None], axis=1)  # [B, K+1, taps, d]
    return n, next_token, accepted_drafts, cache, path_features


def tree_latency_key(model_name: str, target_config: TransformerConfig, batch: int, cache_length: int,
                     tree: TreeConfig, block: int, refined: bool) -> str:
    """What a measured latency model belongs to (machine, model, shapes, how the tree is drafted)."""
    sizes = (1,) + tuple(s for s in tree.node_buckets(block - 1) if s != 1)
    key = LatencyModel.key(model_name, target_config, batch, cache_length, sizes)
    drafted = "refined" if refined else "drafter"
    return f"{key}|{drafted}|{tree.shape}|k{tree.top_k}|w{tree.width}"


def measure_tree_latency(target_params, target_config: TransformerConfig, drafter_params,
                         drafter_config: DrafterConfig, draft_vocab, refiner: RefinerInputs | None, tree: TreeConfig,
                         sampling: SamplingConfig, lengths, cache_length: int, repeats: int = 5,
                         verify_seconds: dict | None = None) -> LatencyModel:
    """Time one verify pass at every node bucket (and at 1, a plain decode step) and the step's
    size-independent part (drafting, tree building) at batch lengths.shape[0] on this machine.

    verify_seconds: a memo of verify times by (batch, cache_length, size), shared between trees of
    any shape or drafter, since a verify pass costs the same whatever its tree looks like.

    Each size's time is its least over `repeats` rounds in which the sizes take turns, and the curve
    is made non-decreasing: on a shared machine, the median of one size's calls in a row can take a
    slow spell for a gap between sizes, which the budget rule would read as real."""
    batch, num_draft = lengths.shape[0], drafter_config.block_size - 1
    verify_seconds = {} if verify_seconds is None else verify_seconds
    sizes = [1] + [s for s in tree.node_buckets(num_draft) if s != 1]
    max_nodes = tree.node_buckets(num_draft)[-1]
    target_cache = KVCache.zeros(target_config, batch, cache_length)
    context = empty_context_cache(drafter_config, batch, cache_length)
    last = jnp.zeros((batch,), jnp.int32)
    head = jax.jit(head_matrix, static_argnums=1)(target_params, target_config, draft_vocab)

    def fixed_part(tp, dp, ctx, h, dv, ref):
        logits, _ = draft_marginals(tp, target_config, dp, drafter_config, last, lengths, ctx, h, dv, ref)
        return build_tree(last, logits, dv, tree, sampling, max_nodes)

    def verify_part(tp, cache, size):
        # A chain-shaped tree of `size` nodes: cost depends on the node count, not the shape.
        depth = jnp.minimum(jnp.arange(size, dtype=jnp.int32), num_draft)
        nodes = DraftTree(token=jnp.zeros((batch, size), jnp.int32),
                          parent=jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32) - 1, (batch, size)),
                          depth=jnp.broadcast_to(depth, (batch, size)),
                          log_prob=jnp.zeros((batch, size)), valid=jnp.ones((batch, size), bool))
        return verify_tree(tp, target_config, nodes, lengths, cache, drafter_config.target_layer_ids, sampling,
                           jax.random.key(0), num_draft)

    print(f"[specjax] measuring tree verification latency at batch {batch}, cache {cache_length} "
          f"(once per machine, model and shape; cached)", file=sys.stderr, flush=True)
    missing = [size for size in sizes if (batch, cache_length, size) not in verify_seconds]
    verify = jax.jit(verify_part, static_argnums=2)
    calls = {size: partial(verify, target_params, target_cache, size) for size in missing}
    for size, seconds in interleaved_min_seconds(repeats, calls).items():
        verify_seconds[batch, cache_length, size] = seconds
    verify_s = monotone_costs([verify_seconds[batch, cache_length, size] for size in sizes])
    fixed = jax.jit(fixed_part)
    fixed_s = median_seconds(repeats, lambda: fixed(target_params, drafter_params, context, head, draft_vocab, refiner))
    return LatencyModel(sizes=sizes, verify_s=verify_s, fixed_s=fixed_s)
