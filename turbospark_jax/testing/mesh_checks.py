"""The tensor-parallel checks, run in a process of its own with simulated CPU devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=N`` must be set before JAX starts, and the
test suite's process has started it with one device, so ``tests/parallel/test_sharding.py`` runs
this module as ``python -m turbospark_jax.testing.mesh_checks`` and asserts on the JSON it
prints:

* the conformance guarantees hold bitwise on a mesh (chunked == token by token, verify ==
  decode, rollback, reuse == fresh, speculative == plain greedy), for the dense family's
  stacked layer layout split 4 ways and list layout split 8 ways, a Qwen3.5 model (DeltaNet
  and gated attention layers) split 4 ways and a Gemma 4 model (ring, per-layer inputs,
  shared-KV layers) split 2 ways, each with a perturbed control that fails;
* a sharded run against the same model on one device: the largest logits difference (it
  is measured, not assumed to be zero) and whether the greedy tokens agree;
* the state and params keep their shardings across calls;
* the Qwen3.5 MTP head and a block drafter drafting for a sharded target in device rounds:
  speculative == plain greedy, bitwise, with a control;
* a mesh size that does not divide the heads is refused;
* a folder loaded shard by shard (dense, Qwen3.5 with its MTP head, Gemma 4) equals the
  one-device load, each shard bitwise against its block, with a control one bit off.
"""

# ruff: noqa: E402 (the simulated devices are asked for before JAX can start)
from __future__ import annotations

from turbospark_jax.engine.loop_graphs import add_xla_flag

add_xla_flag("--xla_force_host_platform_device_count=8")

import dataclasses
import json
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.core.state import live_equal
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.generation.completion import CompletionRequest
from turbospark_jax.generation.driver import run_raw_completion
from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
from turbospark_jax.io.loading import load_folder
from turbospark_jax.io.saving import save_folder
from turbospark_jax.models import block_drafter
from turbospark_jax.models.block_drafter import BlockDrafterConfig
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, unstack_layers
from turbospark_jax.models.gemma4.config import FULL, SLIDING, Gemma4Config
from turbospark_jax.models.gemma4.model import Gemma4Model
from turbospark_jax.models.qwen3_5.config import Qwen35Config
from turbospark_jax.models.qwen3_5.model import Qwen35Model, split_projections
from turbospark_jax.parallel.loading import load_sharded
from turbospark_jax.parallel.replicas import ReplicaPool, replicas_on_devices
from turbospark_jax.parallel.sharding import ShardedProducer, tp_mesh
from turbospark_jax.speculative.drafters import BlockDrafter, MTPDrafter, NGramDrafter
from turbospark_jax.speculative.drafters.block import tapped_target
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_jax.testing import conformance as C

VOCAB = 96
PROMPT = [3, 17, 5, 3, 17, 5, 3, 17, 40, 2, 9]  # repeats, so the n-gram drafter proposes


def config(model_type: str, kv_heads: int, layers: int = 2) -> DenseConfig:
    """A tiny config whose 8 query heads split over 1, 2, 4 or 8 devices."""
    return DenseConfig(
        model_type=model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=16,
        tie_word_embeddings=model_type == "qwen3", attention_bias=model_type == "qwen2",
    )


def _fails(fn: Any) -> bool:
    try:
        fn()
    except C.ConformanceError:
        return True
    return False


def conformance(producer: Any, full: bool) -> dict[str, Any]:
    """The guarantees on ``producer`` (``full``: every one, and one control per kind of
    check; else chunked == sequential and verify == decode, which cover the paths)."""
    C.check_chunked_matches_sequential(producer, PROMPT, [3, 7])
    C.check_verify_matches_decode(producer, PROMPT[:5], [9, 4, 1, 7, 7, 2])
    request = CompletionRequest(prompt_ids=PROMPT, max_tokens=12, record_logits=True)
    plain = run_raw_completion(producer, request)
    result = {"passed": True, "tokens": list(plain.token_ids),
              "logits": np.asarray(plain.logits, np.float32)}
    if not full:
        return result
    C.check_rollback_restores(producer, [("chunk", PROMPT[:5])], [("verify", [1, 2, 3])], 4)
    n = C.check_reuse_matches_fresh(producer, PROMPT[:6], [5, 6], [*PROMPT[:6], 5, 8, 1])
    spec = run_raw_completion_speculative(
        SpeculativePair(producer, NGramDrafter(VOCAB, max_n=3), device_rounds=False),
        dataclasses.replace(request, draft_len=3),
    )
    spec_equal = list(spec.token_ids) == list(plain.token_ids) and all(
        np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
        for a, b in zip(spec.logits, plain.logits, strict=True)
    )
    controls = {
        "chunk_logits_bit": _fails(lambda: C.check_chunked_matches_sequential(
            C.perturbed(producer, "chunk_logits_bit"), PROMPT, [3, 7])),
        "verify_row_bit": _fails(lambda: C.check_verify_matches_decode(
            C.perturbed(producer, "verify_row_bit"), PROMPT[:5], [9, 4])),
    }
    return {**result, "reused": n, "spec_equals_plain": spec_equal, "controls_fire": controls}


def against_one_device(model: Any, params: Any, sharded: dict[str, Any]) -> dict[str, Any]:
    """The same greedy completion on one device: the largest logits gap and token agreement."""
    single = BlockProducer(model, params, capacity=64, width=4, steps_per_call=4)
    request = CompletionRequest(prompt_ids=PROMPT, max_tokens=12, record_logits=True)
    plain = run_raw_completion(single, request)
    want = np.asarray(plain.logits, np.float32)
    got = sharded["logits"]
    return {
        "max_abs_logit_diff": float(np.max(np.abs(got - want))),
        "max_logit": float(np.max(np.abs(want))),
        # the prompt's last row, before either run has picked a token
        "first_step_gap": float(np.max(np.abs(got[0] - want[0]))),
        "bitwise": bool(np.array_equal(got.view(np.uint32), want.view(np.uint32))),
        "same_tokens": list(plain.token_ids) == sharded["tokens"],
    }


def case(
    name: str, model_type: str, kv_heads: int, dtype: Any, tp: int, listed: bool, full: bool,
    layers: int = 2,
) -> dict[str, Any]:
    """One model split ``tp`` ways: its conformance, shardings and gap to one device."""
    cfg = config(model_type, kv_heads, layers)
    model = DenseModel(cfg, dtype, scan_layers=not listed)
    params = model.init_params(jax.random.PRNGKey(7))
    if listed:
        params = unstack_layers(params)
    producer = ShardedProducer(model, params, mesh=tp_mesh(jax.devices()[:tp]), capacity=64,
                               width=4, steps_per_call=4)
    result = conformance(producer, full)
    state = producer.prefill_chunk(producer.init_state(), PROMPT, 0)[1]
    leaf = state.cache.k[0] if listed else state.cache.k
    q_proj = producer.params["layers"][0]["q_proj"] if listed else producer.params["layers"][
        "q_proj"]
    result.update(
        name=name, tp=tp,
        kv_spec=str(leaf.sharding.spec), kv_devices=len(leaf.sharding.device_set),
        q_proj_spec=str(q_proj.sharding.spec),
        kv_shard_shape=list(leaf.addressable_shards[0].data.shape),
        **against_one_device(model, params, result),
    )
    del result["logits"]
    return result


def qwen3_5_model() -> Qwen35Model:
    """A DeltaNet layer and a gated-attention layer; 8 query, 4 KV, 4 key and 8 value heads
    and 64 conv channels: all split 4 ways."""
    return Qwen35Model(Qwen35Config(
        model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
        initializer_range=0.1,
    ), jnp.float32)


def gemma4_model() -> Gemma4Model:
    """Sliding layers of 2 KV heads (split 2 ways) on a ring that the prompt wraps, full
    layers of one KV head (kept whole), per-layer inputs, two shared-KV layers with a
    double-wide MLP."""
    return Gemma4Model(Gemma4Config.from_hf_dict(dict(
        model_type="gemma4_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_hidden_layers=5, layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
        sliding_window=3, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True,
        num_global_key_value_heads=1, final_logit_softcapping=30.0, initializer_range=0.1,
    )), jnp.float32, ring_margin=8)


def snapshot_reuse(producer: Any) -> dict[str, Any]:
    """A model that cannot rewind reuses the snapshot its first prompt's end left: the next
    turn's logits and state equal a fresh run's, bitwise; and the same comparison against
    logits one bit away fails (its control)."""
    first, second = PROMPT[:6], [*PROMPT[:6], 5, 8, 1]
    _, state = producer.prefill_chunk_with_status(producer.init_state(), first, 0, True)
    _, state = producer.produce(state, 4, len(first))  # the next turn does not keep it
    n, state = producer.try_reuse_prefix(state, second)
    got, got_state = C.sequential_prefill(producer, state, second[n:], n)
    want, want_state = C.sequential_prefill(producer, producer.init_state(), second, 0)

    got, want = (np.asarray(x, np.float32).view(np.uint32) for x in (got, want))
    flipped = want.copy()
    flipped.flat[0] ^= 1
    return {"reused": n,
            "equal": np.array_equal(got, want) and live_equal(got_state, want_state),
            "control_fires": not np.array_equal(got, flipped)}


def family_case(name: str, model: Any, tp: int, leaves: dict[str, Any]) -> dict[str, Any]:
    """``model`` split ``tp`` ways: every guarantee, the spec and first shard's shape of the
    named state and params leaves (``leaves``: name -> function of (state, params)), and the
    gap to one device."""
    params = model.init_params(jax.random.PRNGKey(7))
    producer = ShardedProducer(model, params, mesh=tp_mesh(jax.devices()[:tp]), capacity=64,
                               width=4, steps_per_call=4)
    result = conformance(producer, full=True)
    if not producer.can_rewind:
        result["snapshot_reuse"] = snapshot_reuse(producer)
    state = producer.prefill_chunk(producer.init_state(), PROMPT, 0)[1]
    result.update(name=name, tp=tp, **against_one_device(model, params, result))
    for key, pick in leaves.items():
        leaf = pick(state, producer.params)
        result[key] = [str(leaf.sharding.spec), list(leaf.addressable_shards[0].data.shape)]
    del result["logits"]
    return result


def family_cases() -> list[dict[str, Any]]:
    """The Qwen3.5 and Gemma 4 cases."""
    return [
        family_case("qwen3_5_f32_tp4", qwen3_5_model(), 4, {
            "recurrent": lambda s, p: s.cache.recurrent[0],  # [Hv, dk, dv]
            "recurrent_tape": lambda s, p: s.cache.recurrent_tape[0],
            "conv": lambda s, p: s.cache.conv[0],  # [K-1, C]
            "k": lambda s, p: s.cache.k[0],  # [C, KV, hd]
            "in_proj_qkv": lambda s, p: p["layers"][0]["in_proj_qkv"],
            "out_proj": lambda s, p: p["layers"][0]["out_proj"],
            "q_proj": lambda s, p: p["layers"][1]["q_proj"],
        }),
        family_case("gemma4_f32_tp2", gemma4_model(), 2, {
            "k_ring": lambda s, p: s.cache.k_ring[0],  # [R, KV=2, hd]
            "k_full": lambda s, p: s.cache.k_full[0],  # [C, KVg=1, ghd]: whole
            "ring_positions": lambda s, p: s.cache.ring_positions,
            "embed_tokens_per_layer": lambda s, p: p["embed_tokens_per_layer"],
            "per_layer_projection": lambda s, p: p["layers"][0]["per_layer_projection"],
            "shared_layer_down_proj": lambda s, p: p["layers"][4]["down_proj"],  # [2F, D]
        }),
    ]


def sharded_drafters() -> dict[str, Any]:
    """The MTP head and a block drafter over a Qwen3.5 target split 4 ways, in device rounds
    (the drafter's step inside the target's compiled loop, on the mesh): greedy speculative
    == plain greedy, tokens and logits bit for bit, and the logits comparison against a
    plain run one bit off fails (its control). A vocabulary of 8 and a drafter seed picked so
    that proposals are accepted, partly and wholly, and each round rolls back a different
    amount."""
    cfg = dataclasses.replace(qwen3_5_model().config, vocab_size=8, mtp_num_hidden_layers=1)
    drafter_cfg = BlockDrafterConfig(
        hidden_size=cfg.hidden_size, vocab_size=8, target_layer_ids=(0, 1),
        target_num_hidden_layers=2, block_size=4, mask_token_id=1, initializer_range=0.1)
    model = tapped_target(Qwen35Model(cfg, jnp.float32), drafter_cfg)
    target = ShardedProducer(model, model.init_params(jax.random.PRNGKey(7)),
                             mesh=tp_mesh(jax.devices()[:4]), capacity=64, width=4,
                             steps_per_call=4)
    request = CompletionRequest(prompt_ids=[t % 8 for t in PROMPT], max_tokens=16,
                                record_logits=True)
    plain = run_raw_completion(target, request)
    want = np.asarray(plain.logits, np.float32).view(np.uint32)
    flipped = want.copy()
    flipped.flat[-1] ^= 1
    out: dict[str, Any] = {}
    for name, drafter in (
        ("mtp", MTPDrafter(target)),
        ("block", BlockDrafter(target, drafter_cfg,
                               block_drafter.init_params(drafter_cfg, jax.random.PRNGKey(3)))),
    ):
        spec = run_raw_completion_speculative(SpeculativePair(target, drafter),
                                              dataclasses.replace(request, draft_len=3))
        got = np.asarray(spec.logits, np.float32).view(np.uint32)
        out[name] = {"on_device": spec.speculative.on_device,
                     "accepted": list(spec.speculative.accepted_by_position),
                     "equal": list(spec.token_ids) == list(plain.token_ids)
                     and np.array_equal(got, want),
                     "control_fires": not np.array_equal(got, flipped)}
    return out


def refusal() -> str:
    """The message for 4 KV heads over 8 devices (refused before the params are touched)."""
    model = DenseModel(config("llama", 4), jnp.float32)
    try:
        ShardedProducer(model, {}, mesh=tp_mesh(jax.devices()[:8]), capacity=16)
    except BadInputError as e:
        return str(e)
    return ""


def shard_by_shard(got: Any, want: Any) -> dict[str, Any]:
    """Each shard of each ``got`` leaf against the same block of the one-device ``want``,
    bit for bit; the count of leaves actually split; and the same comparison against a
    ``want`` one bit away in one split leaf (its control)."""

    def bits(x: Any) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(x)).view(np.uint8)

    def equal(want_leaves: list[np.ndarray]) -> bool:
        return all(
            np.array_equal(bits(shard.data), bits(w[shard.index]))
            for g, w in zip(jax.tree.leaves(got), want_leaves, strict=True)
            for shard in g.addressable_shards
        )

    want_leaves = [np.asarray(w) for w in jax.tree.leaves(want)]
    split = [i for i, g in enumerate(jax.tree.leaves(got))
             if g.addressable_shards[0].data.shape != g.shape]
    flipped = list(want_leaves)
    flipped[split[-1]] = want_leaves[split[-1]].copy()
    flipped[split[-1]].view(np.uint8).flat[-1] ^= 1  # a bit of the last shard's last element
    same_tree = jax.tree.structure(got) == jax.tree.structure(want)
    return {"equal": same_tree and equal(want_leaves), "split_leaves": len(split),
            "control_fires": not equal(flipped)}


def sharded_load() -> dict[str, Any]:
    """Saved folders (in several files) loaded shard by shard against ``load_folder``: the
    dense family in both layer layouts over 4 devices, Qwen3.5 with its MTP head over 4 and
    Gemma 4 over 2."""
    cfg = config("qwen2", 4)
    model = DenseModel(cfg, jnp.float32)
    folder = tempfile.mkdtemp()
    save_folder(folder, cfg, model.init_params(jax.random.PRNGKey(3)), max_shard_bytes=40_000)
    ref = load_folder(folder)
    out = {}
    for layout in ("stacked", "list"):  # the stacked one reads a slice per layer and stacks
        got = load_sharded(folder, tp_mesh(jax.devices()[:4]), layer_layout=layout)
        want = ref.params if layout == "stacked" else unstack_layers(ref.params)
        out[layout] = shard_by_shard(got.params, want)
        up = got.params["layers"][0]["up_proj"] if layout == "list" else got.params[
            "layers"]["up_proj"]
        out[f"{layout}_up_proj_shard"] = list(up.addressable_shards[0].data.shape)
    qwen = qwen3_5_model()
    qwen = Qwen35Model(dataclasses.replace(qwen.config, mtp_num_hidden_layers=1), jnp.float32)
    for name, family_model, tp in (("qwen3_5_mtp", qwen, 4), ("gemma4", gemma4_model(), 2)):
        folder = tempfile.mkdtemp()
        save_folder(folder, family_model.config, family_model.init_params(jax.random.PRNGKey(3)),
                    max_shard_bytes=40_000)
        got = load_sharded(folder, tp_mesh(jax.devices()[:tp]), layer_layout="list")
        plain = load_folder(folder, layer_layout="list").params
        if name == "qwen3_5_mtp":  # the mesh keeps the DeltaNet projections apart
            plain = split_projections(family_model.config, plain)
        out[name] = shard_by_shard(got.params, plain)
        if name == "qwen3_5_mtp":  # the MTP head's layer; conv1d, [C, 1, K] in the file
            mtp = got.params["mtp"]["layers"][0]
            out["shards"] = {k: list(leaf.addressable_shards[0].data.shape) for k, leaf in (
                ("mtp_q_proj", mtp["q_proj"]), ("mtp_down_proj", mtp["down_proj"]),
                ("conv1d", got.params["layers"][0]["conv1d"]))}
        else:  # a full layer's o_proj [H, ghd, D]
            out["shards"]["gemma4_o_proj"] = list(
                got.params["layers"][1]["o_proj"].addressable_shards[0].data.shape)
    return out


def data_parallel() -> dict[str, Any]:
    """Two replicas on devices 2 and 3 of the 8: each session's KV stays on its replica's
    device, and the replicas answer alike."""
    # The second case's model: its params come from the same compiled initialiser.
    model = DenseModel(config("llama", 8, layers=1), jnp.bfloat16, scan_layers=False)
    params = unstack_layers(model.init_params(jax.random.PRNGKey(7)))
    devices = jax.devices()[2:4]
    pool = ReplicaPool(replicas_on_devices(model, params, devices=devices, capacity=16, width=4,
                                           steps_per_call=4), slots=1)
    request = CompletionRequest(prompt_ids=PROMPT[:6], max_tokens=4)
    out: dict[str, Any] = {"tokens": [], "kv_devices": {}}
    for session in ("a", "b"):
        out["tokens"].append(list(pool.generate(session, request).token_ids))
        state = pool.pool_of(session).state_of(session)
        out["kv_devices"][session] = [
            pool.replica_of(session), sorted(d.id for d in state.cache.k[0].sharding.device_set)]
    out["same_tokens"] = out["tokens"][0] == out["tokens"][1]
    out["device_ids"] = [d.id for d in devices]
    return out


def main() -> None:
    report = {
        "devices": jax.device_count(),
        "cases": [
            case("qwen3_f32_stacked_tp4", "qwen3", 4, jnp.float32, 4, listed=False,
                 full=True),
            case("llama_bf16_list_tp8", "llama", 8, jnp.bfloat16, 8, listed=True,
                 full=False, layers=1),
        ],
        "families": family_cases(),
        "refusal": refusal(),
        "sharded_load": sharded_load(),
        "sharded_drafters": sharded_drafters(),
        "data_parallel": data_parallel(),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
