"""The shared mixture-of-experts layer (:mod:`turbospark_jax.models.moe`).

* It computes what ``transformers``' sparse blocks compute (Qwen3-MoE's, with and without
  renormalised top-k; Qwen3-Next's, with the sigmoid-gated shared expert), float32, within
  float32 rounding.
* A row's output does not depend on the rows beside it: under the row-invariant form, bit for
  bit whatever the row count and whatever the other rows hold (they route to other experts);
  the control shows the check sees a change to the row itself.
* A one-row call reads its ``k`` experts' weights, not the stack (the grouped tiles slice one
  expert each; the grouped products themselves are tested in ``test_moe_grouped.py``).
* Quantized expert stacks multiply as their dequantized weights do, bit for bit.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.errors import ModelLoadError
from turbospark_jax.models import moe
from turbospark_jax.quant.weights import Quantization, is_quantized, quantize_leaf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

D, F, E, K, S = 16, 8, 8, 2, 12


def _hf_block(kind: str, normalize: bool):
    common = dict(hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                  norm_topk_prob=normalize)
    if kind == "next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
        config = transformers.Qwen3NextConfig(**common, shared_expert_intermediate_size=S)
        block = Qwen3NextSparseMoeBlock(config)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        block = Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(**common))
    torch.manual_seed(3)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block.float().eval()


def _ours(block) -> dict:
    """The block's weights in our layout: experts ``[E, in, out]``, the router as stored."""
    t = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    gate_up = t["experts.gate_up_proj"]  # [E, 2F, D]
    w = {"router": jnp.asarray(t["gate.weight"]),
         "expert_gate": jnp.asarray(gate_up[:, :F].transpose(0, 2, 1)),
         "expert_up": jnp.asarray(gate_up[:, F:].transpose(0, 2, 1)),
         "expert_down": jnp.asarray(t["experts.down_proj"].transpose(0, 2, 1))}
    if "shared_expert_gate.weight" in t:
        w.update(shared_gate=jnp.asarray(t["shared_expert.gate_proj.weight"].T),
                 shared_up=jnp.asarray(t["shared_expert.up_proj.weight"].T),
                 shared_down=jnp.asarray(t["shared_expert.down_proj.weight"].T),
                 shared_expert_gate=jnp.asarray(t["shared_expert_gate.weight"].T))
    return w


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, D)).astype(np.float32)


@pytest.mark.parametrize("kind, normalize", [("qwen3_moe", False), ("qwen3_moe", True),
                                             ("next", True)])
@pytest.mark.parametrize("row_invariant", [False, True])
def test_block_matches_transformers(kind, normalize, row_invariant):
    block = _hf_block(kind, normalize)
    x = _rows(9)
    with torch.no_grad():
        want = block(torch.tensor(x)[None]).numpy()[0]
    got = moe.moe_block(jnp.asarray(x), _ours(block), moe.Routing(E, K, normalize),
                        row_invariant=row_invariant)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("normalize", [False, True])
def test_block_matches_transformers_in_bfloat16(normalize):
    """In bfloat16 too: the router's logits rounded before the float32 softmax, the weights
    rounded before they scale the terms, the terms added in expert order. (Qwen3-Next's
    block is left out: on these rows its router ties two experts in bfloat16, and the two
    libraries break the tie differently.)"""
    block = _hf_block("qwen3_moe", normalize)
    weights = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _ours(block))
    x = _rows(64)
    with torch.no_grad():
        want = block.to(torch.bfloat16)(torch.tensor(x).to(torch.bfloat16)[None])[0]
    got = moe.moe_block(jnp.asarray(x, jnp.bfloat16), weights, moe.Routing(E, K, normalize),
                        row_invariant=False)
    bound = 2**-7 * float(np.abs(want.float().numpy()).max())
    err = np.abs(np.asarray(got.astype(jnp.float32)) - want.float().numpy())
    assert float(err.max()) <= bound
    # Control: the other renormalisation rule is seen.
    other = moe.moe_block(jnp.asarray(x, jnp.bfloat16), weights,
                          moe.Routing(E, K, not normalize), row_invariant=False)
    assert float(np.abs(np.asarray(other.astype(jnp.float32))
                        - want.float().numpy()).max()) > bound


_invariant_block = jax.jit(moe.moe_block, static_argnames=("routing", "row_invariant"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_rows_bits_do_not_depend_on_its_neighbours(dtype):
    weights = jax.tree.map(lambda a: a.astype(dtype), _ours(_hf_block("next", True)))
    routing = moe.Routing(E, K, True)
    x = jnp.asarray(_rows(11), dtype)

    def run(rows):
        return np.asarray(_invariant_block(rows, weights, routing=routing,
                                           row_invariant=True).astype(jnp.float32))

    whole = run(x)
    for n in (1, 2, 5, 8):  # other row counts: other programs
        assert np.array_equal(run(x[:n]), whole[:n]), n
    # Other rows, routed elsewhere: row 3 keeps its bits.
    others = jnp.asarray(_rows(11, seed=7), dtype).at[3].set(x[3])
    assert np.array_equal(run(others)[3], whole[3])
    # Control: a change to row 3 itself shows.
    assert not np.array_equal(run(x.at[3, 0].add(0.5))[3], whole[3])


def test_decode_reads_only_its_experts():
    """A one-row call's program touches each expert stack only through slices of one expert
    (the grouped tiles' dynamic slices, or a gather), never the whole stack: the stacks
    only pass through the loop over tiles to the instructions that slice them."""
    e, d, f = 64, 32, 48
    weights = {"router": jnp.zeros((e, d)), "expert_gate": jnp.zeros((e, d, f)),
               "expert_up": jnp.zeros((e, d, f)), "expert_down": jnp.zeros((e, f, d))}
    text = jax.jit(moe.moe_block, static_argnames=("routing", "row_invariant")).lower(
        jnp.ones((1, d)), weights, routing=moe.Routing(e, 2, False),
        row_invariant=False).compile().as_text()
    stacks = (f"f32[{e},{d},{f}]", f"f32[{e},{f},{d}]")
    readers = _stack_readers(text, stacks)
    assert readers and all(_reads_one_expert(line) for line in readers), readers
    assert f"dynamic_slice_sizes={{1,{d},{f}}}" in text
    assert f"dynamic_slice_sizes={{1,{f},{d}}}" in text


def test_control_a_whole_stack_read_is_seen():
    """The check can fail: a program that multiplies by every expert reads the stack whole."""
    stack = jnp.zeros((64, 32, 48))
    text = jax.jit(lambda x, w: jnp.einsum("td,edf->tef", x, w)).lower(
        jnp.ones((1, 32)), stack).compile().as_text()
    readers = _stack_readers(text, ("f32[64,32,48]",))
    assert readers and not all(_reads_one_expert(line) for line in readers)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
#: Instructions that hand a stack on without reading it (a fusion's own instructions are
#: checked in its computation).
_PASS_ON = ("parameter", "tuple", "while", "get-tuple-element", "fusion", "bitcast")


def _stack_readers(text: str, stacks: tuple[str, ...]) -> list[str]:
    """The instructions of the compiled module ``text`` (in every computation, fused ones
    too) that take an operand typed as an expert stack, other than those that pass it on."""
    types, lines = {}, []
    for line in text.splitlines():
        found = _INSTRUCTION.match(line)
        if found:
            types[found.group(1)] = found.group(2).split(" ", 1)[0]
            lines.append(found.group(2))
    readers = []
    for rest in lines:
        opcode = re.match(r"(?:\(.*?\)|\S+) ([\w\-]+)\(", rest)
        if opcode is None or opcode.group(1) in _PASS_ON:
            continue
        operands = re.findall(r"(?<![=\w])%([\w.\-]+)", rest.split("),", 1)[0])
        if any(types.get(name, "").startswith(stacks) for name in operands):
            readers.append(rest)
    return readers


def _reads_one_expert(line: str) -> bool:
    """Whether an instruction that takes a stack reads one expert's slice of it."""
    sizes = re.search(r"(?:dynamic_)?slice_sizes=\{1,", line)
    return sizes is not None and (" dynamic-slice(" in line or " gather(" in line)


def test_quantized_experts_multiply_as_their_dequantized_weights():
    weights = _ours(_hf_block("qwen3_moe", True))
    spec = Quantization.parse("int8")
    quantized = dict(weights)
    for key, k in (("expert_gate", D), ("expert_up", D), ("expert_down", F)):
        quantized[key] = quantize_leaf(np.asarray(weights[key]), k, 1, spec, jnp.float32)
        assert is_quantized(quantized[key]) and quantized[key].lead == (E,)
    plain = {k: (v.dequantize(jnp.float32) if is_quantized(v) else v)
             for k, v in quantized.items()}
    routing = moe.Routing(E, K, True)
    x = jnp.asarray(_rows(6))
    for row_invariant in (False, True):
        got = _invariant_block(x, quantized, routing=routing, row_invariant=row_invariant)
        want = _invariant_block(x, plain, routing=routing, row_invariant=row_invariant)
        assert np.array_equal(np.asarray(got), np.asarray(want))
    # Control: the quantized experts are not the float ones.
    exact = _invariant_block(x, weights, routing=routing, row_invariant=False)
    assert not np.array_equal(np.asarray(exact), np.asarray(got))


def test_terms_add_in_expert_order():
    """The ``k`` terms add in the order of their expert index whatever order the router
    ranked them in (as the reference's loop over experts adds them)."""
    rng = np.random.default_rng(1)
    gate, up, down = (jnp.asarray(rng.normal(size=s), jnp.bfloat16)
                      for s in ((E, D, F), (E, D, F), (E, F, D)))
    x = jnp.asarray(_rows(4), jnp.bfloat16)
    experts = jnp.asarray([[5, 1, 3]] * 4, jnp.int32)
    weights = jnp.asarray([[0.5, 0.3, 0.2]] * 4, jnp.float32)
    order = jnp.asarray([1, 2, 0])
    a = moe.routed_experts(x, weights, experts, gate, up, down)
    b = moe.routed_experts(x, weights[:, order], experts[:, order], gate, up, down)
    assert np.array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_routing_is_checked():
    with pytest.raises(ModelLoadError, match="num_experts must be positive"):
        moe.Routing(0, 1, False)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        moe.Routing(4, 5, False)
    assert dataclasses.replace(moe.Routing(4, 2, True), top_k=4).top_k == 4


# -- helpers the MoE family tests share ---------------------------------------------------------


def fixture_tokenizer() -> Any:
    """The byte-level fixture tokenizer as a transformers tokenizer, for folders both sides
    read."""
    from turbospark_jax.testing.tokenizers import byte_level_bpe

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(), bos_token="<|bos|>", eos_token="<|eos|>",
        pad_token="<|pad|>")


def hf_greedy_text(hf: Any, fast: Any, prompt: str, new_tokens: int) -> str:
    """``transformers``' greedy continuation of ``prompt``, decoded."""
    ids = fast.encode(prompt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    return fast.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def cli_text(path: Any, prompt: str, new_tokens: int) -> str:
    """What ``turbospark-jax generate`` prints for ``prompt`` on the folder."""
    import io

    from turbospark_jax.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = main(["generate", "--model", str(path), prompt, "--max-tokens", str(new_tokens),
                 "--context", "128"], stdin=io.StringIO(""), stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    return out.getvalue()


def check_conformance_with_controls(producer: Any, prompt: list[int]) -> None:
    """Chunked == token by token, verify == decode and reuse == fresh on ``producer``, each
    also run on a producer wrong by one bit or one position, where it must fail."""
    from turbospark_jax.testing import conformance as C

    checks = {
        "chunk_logits_bit": lambda p: C.check_chunked_matches_sequential(p, prompt, [2, 7]),
        "verify_row_bit": lambda p: C.check_verify_matches_decode(p, prompt[:5], prompt[5:9]),
        "reuse_claims_one_more": lambda p: C.check_reuse_matches_fresh(
            p, prompt, [7], [*prompt, 7, 8]),
    }
    for control, check in checks.items():
        check(producer)
        with pytest.raises(C.ConformanceError):
            check(C.perturbed(producer, control))
