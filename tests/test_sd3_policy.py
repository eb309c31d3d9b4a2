"""SD3 policy adapter over a tiny random SD3 built offline (no hub, no GPU)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from flowgrpo.config import ModelConfig
from flowgrpo.errors import UserError
from flowgrpo.policies import build_policy
from flowgrpo.policies.sd3 import SD3Policy, build_sd3_policy
from flowgrpo.policies.sd3_tiny import tiny_sd3_components, tiny_sd3_pipeline

PROMPTS = ["a red circle left of a blue square", "two green triangles", "a photo of a cat", ""]
SEQ = 32  # T5 tokens


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny models: threading only adds overhead (and thrashes when the CPU is shared)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_policy(**kw) -> SD3Policy:
    kw.setdefault("resolution", 64)
    kw.setdefault("max_sequence_length", SEQ)
    return SD3Policy.from_components(tiny_sd3_components(seed=0), **kw)


def inputs(policy, b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, *policy.latent_shape, generator=g), torch.rand(b, generator=g)


def perturb_lora(policy, seed=1, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_trainable_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_tiny_components_deterministic_and_rng_neutral():
    state = torch.get_rng_state()
    a, b, c = tiny_sd3_components(seed=0), tiny_sd3_components(seed=0), tiny_sd3_components(seed=1)
    assert torch.equal(state, torch.get_rng_state())  # the caller's RNG is untouched
    for key in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        sa, sb, sc = a[key].state_dict(), b[key].state_dict(), c[key].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), key
        assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point()), key
    ids = a["tokenizer"](["a red circle"]).input_ids[0]
    assert ids[0] == a["tokenizer"].bos_token_id and ids[-1] == a["tokenizer"].eos_token_id
    assert a["tokenizer_3"](["a red circle"]).input_ids[0][-1] == a["tokenizer_3"].eos_token_id


def test_latent_shape_velocity_shape_and_dtype():
    policy = make_policy()
    assert policy.latent_shape == (16, 8, 8)
    cond = policy.encode_prompts(PROMPTS)
    assert cond.tensors["prompt_embeds"].shape == (4, 16 + SEQ, 96)
    assert cond.tensors["pooled_prompt_embeds"].shape == (4, 80)
    x, s = inputs(policy)
    v = policy.velocity(x, s, cond)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert SD3Policy.from_components(tiny_sd3_components(), resolution=128).latent_shape == (16, 16, 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        make_policy(resolution=72)

    bf = make_policy(dtype="bfloat16")
    vb = bf.velocity(x, s, bf.encode_prompts(PROMPTS))
    assert vb.dtype == torch.bfloat16 and vb.shape == x.shape  # returned as produced; the caller casts
    assert all(p.dtype == torch.float32 for p in bf.trainable_parameters())  # LoRA trains in fp32


def test_encoding_matches_stock_pipeline():
    policy = make_policy(train_mode="frozen")
    pipe = tiny_sd3_pipeline(seed=0)
    with torch.no_grad():
        emb, _, pooled, _ = pipe.encode_prompt(PROMPTS, None, None, device=torch.device("cpu"),
                                               do_classifier_free_guidance=False, max_sequence_length=SEQ)
    enc = policy._encode(PROMPTS)
    torch.testing.assert_close(enc["prompt_embeds"], emb, rtol=0, atol=1e-6)
    torch.testing.assert_close(enc["pooled_prompt_embeds"], pooled, rtol=0, atol=1e-6)


def test_cfg_combines_two_passes():
    g = 4.5
    policy = make_policy(guidance_scale=g)
    cond = policy.encode_prompts(PROMPTS[:3])
    assert cond.uncond is not None
    x, s = inputs(policy, b=3)
    with torch.no_grad():
        v = policy.velocity(x, s, cond)
        v_c = policy._forward(x, s, cond.tensors)
        v_u = policy._forward(x, s, {k: t.expand(3, *t.shape[1:]) for k, t in cond.uncond.items()})
        v_1 = policy.velocity(x, s, cond, guidance_scale=1.0)
    assert (v_c - v_u).abs().max() > 1e-4  # the prompt matters
    torch.testing.assert_close(v, v_u + g * (v_c - v_u), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_1, v_c, rtol=1e-5, atol=1e-5)


def test_lora_starts_as_identity_then_differs():
    policy = make_policy(lora_rank=4, lora_alpha=8.0)
    cond = policy.encode_prompts(PROMPTS)
    x, s = inputs(policy)
    with torch.no_grad():
        v0 = policy.velocity(x, s, cond)
    ref = policy.reference_velocity(x, s, cond)
    torch.testing.assert_close(v0, ref, rtol=0, atol=1e-6)
    perturb_lora(policy)
    with torch.no_grad():
        v1 = policy.velocity(x, s, cond)
    assert (v1 - v0).abs().max() > 1e-3
    torch.testing.assert_close(policy.reference_velocity(x, s, cond), ref, rtol=0, atol=1e-6)
    with torch.no_grad():  # adapters re-enabled after the reference pass
        torch.testing.assert_close(policy.velocity(x, s, cond), v1)


def test_only_lora_is_trainable_and_gets_gradients():
    policy = make_policy(lora_rank=4, lora_alpha=8.0).train()
    assert policy.transformer.training
    assert not any(m.training for m in (policy.text_encoder, policy.text_encoder_2, policy.text_encoder_3, policy.vae))
    named = dict(policy.named_trainable_parameters())
    assert named and all("lora_" in n for n in named)
    assert all(n.startswith("transformer.") for n in named)
    for n, p in policy.named_parameters():
        assert p.requires_grad == (n in named), n
    for target in (".attn.to_q.", ".attn.add_q_proj.", ".attn.to_add_out.", ".attn2.to_q.", ".ff.net.0.proj.",
                   ".ff_context.net.2."):
        assert any(target in n for n in named), target

    cond = policy.encode_prompts(PROMPTS)
    x, s = inputs(policy)
    policy.velocity(x, s, cond).square().mean().backward()
    grads = [p.grad for n, p in named.items() if "lora_B" in n]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for n, p in policy.named_parameters() if n not in named)

    full = make_policy(train_mode="full")
    assert {id(p) for p in full.trainable_parameters()} == {id(p) for p in full.transformer.parameters()}
    for enc in (full.text_encoder, full.text_encoder_2, full.text_encoder_3, full.vae):
        assert not any(p.requires_grad for p in enc.parameters())
    full.snapshot_reference()
    with torch.no_grad():
        v0 = full.velocity(x, s, full.encode_prompts(PROMPTS))
        for p in full.trainable_parameters():
            p.add_(0.01)
    torch.testing.assert_close(full.reference_velocity(x, s, full.encode_prompts(PROMPTS)), v0)
    assert make_policy(train_mode="frozen").trainable_parameters() == []


def test_decode_range_and_shape():
    policy = make_policy(train_mode="frozen")
    x, _ = inputs(policy, b=3)
    with torch.no_grad():
        img = policy.decode(x)
    assert img.shape == (3, 3, 64, 64) and img.dtype == torch.float32
    assert img.min() >= 0.0 and img.max() <= 1.0


def test_save_lora_loads_into_stock_pipeline(tmp_path):
    policy = make_policy(lora_rank=4, lora_alpha=8.0)  # scale 2 != 1: alpha must travel with the weights
    perturb_lora(policy)
    out = policy.save_lora(tmp_path / "lora")
    assert (out / "pytorch_lora_weights.safetensors").is_file()

    pipe = tiny_sd3_pipeline(seed=0)
    pipe.load_lora_weights(str(out))
    cond = policy.encode_prompts(PROMPTS)
    x, s = inputs(policy)
    args = dict(hidden_states=x, timestep=s * 1000, encoder_hidden_states=cond.tensors["prompt_embeds"],
                pooled_projections=cond.tensors["pooled_prompt_embeds"], return_dict=False)
    with torch.no_grad():
        ours = policy.transformer(**args)[0]
        theirs = pipe.transformer(**args)[0]
        base = policy.reference_velocity(x, s, cond)
    assert (ours - base).abs().max() > 1e-3  # the adapter does something
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lora"):
        make_policy(train_mode="full").save_lora(tmp_path / "x")


def test_build_from_local_folder_and_registry(tmp_path):
    with pytest.raises(UserError, match="nowhere"):
        build_sd3_policy(ModelConfig(name="sd3", path=str(tmp_path / "nowhere")))
    with pytest.raises(UserError, match="model.path"):
        build_sd3_policy(ModelConfig(name="sd3", path=None))

    tiny_sd3_pipeline(seed=0).save_pretrained(tmp_path / "pipe")
    cfg = ModelConfig(name="sd3", path=str(tmp_path / "pipe"), resolution=64, max_sequence_length=SEQ,
                      guidance_scale=3.0, lora_rank=4, lora_alpha=4.0)
    loaded = build_policy(cfg)
    tiny = build_policy(ModelConfig(name="sd3-tiny", resolution=64, max_sequence_length=SEQ, guidance_scale=3.0))
    assert isinstance(loaded, SD3Policy) and isinstance(tiny, SD3Policy)
    assert loaded.latent_shape == tiny.latent_shape == (16, 8, 8)
    x, s = inputs(tiny)
    with torch.no_grad():
        torch.testing.assert_close(loaded.velocity(x, s, loaded.encode_prompts(PROMPTS)),
                                   tiny.velocity(x, s, tiny.encode_prompts(PROMPTS)), rtol=1e-5, atol=1e-5)
