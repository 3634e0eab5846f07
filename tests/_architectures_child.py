"""Child process of tests/test_architectures.py: tiny transformers models of the architectures
people use, compiled with ``compile_regions(model, cache_dir=STORE, precompile=True)`` (Inductor,
random weights, nothing downloaded), each call compared with eager.

    python _architectures_child.py STORE PHASE [ARCH,...] [CALLS]    PHASE: publish | load

Prints one line ``ARCH {json}`` per architecture: the largest difference from eager per call
(forward; a training step's loss and gradients; generated tokens), the warnings of compile_cache
and of torch, Dynamo frames traced, FX-graph cache hits and misses (all calls), and the report's
per-group precompile outcome. benchmarks/bench_architectures.py runs it too: STORE ``off`` (no
store: torch's own caches), PHASE ``plain`` (``precompile=False``) or ``eager`` (no compile),
CALLS ``forward`` or ``generate`` (that call alone; default: all of the architecture's).
"""

from __future__ import annotations

import copy
import json
import sys
import time
import traceback
import warnings

import torch
import transformers as T
from torch._dynamo.utils import counters

import compile_cache

STORE, PHASE = "", ""
V = 64  # vocabulary
NO_DROP = dict(attention_dropout=0.0, dropout=0.0, activation_dropout=0.0)


def ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def pixels(size: int) -> torch.Tensor:
    return torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))


def build(arch: str) -> tuple[torch.nn.Module, dict, str]:
    """(model, forward inputs, what the training step / generate reads)."""
    if arch == "bert":
        cfg = T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
        return T.BertModel(cfg), {"input_ids": ids(8)}, "train"
    if arch == "vit":
        cfg = T.ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
        return T.ViTModel(cfg, add_pooling_layer=False), {"pixel_values": pixels(16)}, ""
    if arch == "whisper":
        cfg = T.WhisperConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                              encoder_attention_heads=2, decoder_attention_heads=2,
                              encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                              max_source_positions=8, max_target_positions=16, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, **NO_DROP)
        feats = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(2))
        return T.WhisperModel(cfg), {"input_features": feats, "decoder_input_ids": ids(4),
                                     "use_cache": False}, ""
    if arch == "bart":
        cfg = T.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_position_embeddings=32, **NO_DROP)
        return T.BartModel(cfg), {"input_ids": ids(8), "decoder_input_ids": ids(4, 1),
                                  "use_cache": False}, ""
    if arch == "t5":
        cfg = T.T5Config(vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                         num_decoder_layers=2, num_heads=2, dropout_rate=0.0, decoder_start_token_id=0,
                         pad_token_id=0, eos_token_id=1)
        return T.T5ForConditionalGeneration(cfg), {"input_ids": ids(8), "labels": ids(4, 1),
                                                   "use_cache": False}, "train,generate"
    if arch == "gemma":
        cfg = T.GemmaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            max_position_embeddings=32)
        return T.GemmaModel(cfg), {"input_ids": ids(8), "use_cache": False}, ""
    if arch == "mamba":
        cfg = T.MambaConfig(vocab_size=V, hidden_size=32, state_size=8, num_hidden_layers=2,
                            expand=2, conv_kernel=4)
        return T.MambaModel(cfg), {"input_ids": ids(8), "use_cache": False}, ""
    if arch == "qwen2":
        cfg = T.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return T.Qwen2ForCausalLM(cfg), {"input_ids": ids(8), "use_cache": False}, "generate"
    if arch == "mixtral":
        cfg = T.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                              num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32)
        return T.MixtralForCausalLM(cfg), {"input_ids": ids(8), "labels": ids(8, 3),
                                           "use_cache": False}, "train"
    if arch == "clip":
        cfg = T.CLIPConfig(
            text_config=dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=16),
            vision_config=dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2),
            projection_dim=16)
        return T.CLIPModel(cfg), {"input_ids": ids(8), "pixel_values": pixels(16)}, ""
    raise ValueError(arch)


ARCHS = ["bert", "vit", "whisper", "bart", "t5", "gemma", "mamba", "qwen2", "mixtral", "clip"]


def first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for key in ("loss", "logits", "last_hidden_state", "logits_per_image"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return out[0]


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def run(arch: str, calls: str = "") -> dict:
    """Build, compile, call and compare one architecture (module doc)."""
    rec: dict = {"arch": arch, "phase": PHASE, "diffs": {}}
    frames0, misses0 = counters["frames"]["ok"], counters["inductor"]["fxgraph_cache_miss"]
    hits0 = counters["inductor"]["fxgraph_cache_hit"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.manual_seed(0)
            model, inputs, extra = build(arch)
            model.eval()
            ref = copy.deepcopy(model)
            extra = calls or extra
            start = time.perf_counter()
            if PHASE != "eager":
                compile_cache.compile_regions(model, cache_dir=False if STORE == "off" else STORE,
                                              precompile=PHASE != "plain")
            report = compile_cache.last_report() if STORE != "off" and PHASE != "eager" else None
            if calls != "generate":
                with torch.no_grad():
                    out = first_tensor(model(**inputs))
                    rec["first_output_s"] = time.perf_counter() - start
                    rec["diffs"]["forward"] = maxdiff(out, first_tensor(ref(**inputs)))
            if "train" in extra:
                for net in (model, ref):
                    net.train()
                loss = first_tensor(model(**inputs)).float().pow(2).mean()
                want = first_tensor(ref(**inputs)).float().pow(2).mean()
                loss.backward()
                want.backward()
                rec["diffs"]["train_loss"] = maxdiff(loss, want)
                rec["diffs"]["grads"] = max(
                    maxdiff(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
                    if p.grad is not None and q.grad is not None)
                for net in (model, ref):
                    net.eval()
            if "generate" in extra:
                prompt = ids(6, 5)
                kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
                with torch.no_grad():
                    got = model.generate(prompt, **kw)
                    rec["first_generate_s"] = time.perf_counter() - start
                    wanted = ref.generate(prompt, **kw)
                rec["diffs"]["generate"] = 0.0 if torch.equal(got, wanted) else 1.0
            if report is not None:  # (benchmarks: no store, or eager)
                compile_cache.session.flush(60)
                rec["groups"] = report.precompile_groups
                rec["summary"] = report.summary()
                rec["restored_packs"] = report.restored_packs
                rec["precompile_declined"] = report.precompile_declined
                rec["region_stats"] = compile_cache.region_stats(model)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc()[-3000:]
    _observe(rec, caught, frames0, misses0, hits0)
    return rec


def _observe(rec: dict, caught: list, frames0: int, misses0: int, hits0: int) -> None:
    rec["frames"] = counters["frames"]["ok"] - frames0
    rec["fx_misses"] = counters["inductor"]["fxgraph_cache_miss"] - misses0
    rec["fx_hits"] = counters["inductor"]["fxgraph_cache_hit"] - hits0
    rec["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                       if issubclass(w.category, (compile_cache.RegionPrecompileWarning,
                                                  compile_cache.RegionEagerWarning,
                                                  compile_cache.RegionRecompileWarning))]
    rec["torch_warnings"] = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                             if "/torch/" in w.filename.replace("\\", "/")
                             and not issubclass(w.category, DeprecationWarning)]


if __name__ == "__main__":
    STORE, PHASE = sys.argv[1], sys.argv[2]
    for name in (sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else ARCHS):
        print("ARCH " + json.dumps(run(name, sys.argv[4] if len(sys.argv) > 4 else ""),
                                   default=str), flush=True)
