"""Shared pieces of the model tests: a tiny Llama-shaped spec, its HF checkpoint, and the per-rank serving run
(prefill every sequence of this rank's replica, then greedy decode steps) executed in gloo processes."""

from __future__ import annotations

import functools

import torch

from modules.model_specs import GPT_OSS_ROPE, LLAMA3_ROPE, TextModelSpec

# Tiny Llama-shaped: GQA 16 Q / 2 KV heads (KV replicated from tp 4 on), vocab 100 (padded on 8 and 16 shards);
# both tiny models keep their family's RoPE scaling (llama3 / YaRN: at head_dim 8 it rescales the lower half).
TINY_LLAMA = TextModelSpec("tiny-llama", layers=2, hidden=64, intermediate=128, heads=16, kv_heads=2, head_dim=8,
                           vocab=100, rope=LLAMA3_ROPE)
# Tiny GPT-OSS: q/k/v/o biases, sinks, a 4-token sliding window on even layers, and a 4-expert top-2 MoE
# (modules.moe) in the MLP slot.
TINY_GPT_OSS = TextModelSpec("tiny-gpt-oss", layers=2, hidden=64, intermediate=64, heads=16, kv_heads=2, head_dim=8,
                             vocab=100, experts=4, top_k=2, sliding_window=4, attention_bias=True, rope=GPT_OSS_ROPE)
PROMPT_LENGTHS = (5, 11, 3, 17)  # 4 sequences; prefill buckets 16 / 32
PREFILL_BUCKETS, DECODE_BUCKETS, S_MAX = (16, 32), (1, 2, 4), 48


def prompts(vocab: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in PROMPT_LENGTHS]


def serve(rank, world_size, spec, config_kwargs, ckpt, steps=3, flow="optimised", attn_backend="torch",
          dtype=torch.float32, warmup=False, log_layer_step=None, pipelined=True, s_max=S_MAX, sequences=None,
          mlp_backend="torch"):
    """One rank: build groups, load both graphs from the checkpoint, prefill this replica's sequences, decode.

    Returns per-replica results (equal on every rank of a replica) and, when log_layer_step is a decode step
    index, the collective logs of that step as [(op, group name)] (bypassed size-1 calls excluded): layer 0's
    ("layer_log") and the whole step's ("step_log", ending with the check's own all-gather of the logits).
    """
    from modules.config import NeuronConfig
    from modules.loading import SafetensorsCheckpoint
    from modules.models import ModelRunner, gpt_oss_mlp, gpt_oss_mlp_mappings, llama_mlp, llama_mlp_mappings
    from modules.parallel.state import initialize_parallel_state

    cfg = NeuronConfig(prefill_buckets=PREFILL_BUCKETS, decode_buckets=DECODE_BUCKETS, **config_kwargs)
    state = initialize_parallel_state(cfg)
    moe = functools.partial(gpt_oss_mlp, backend=mlp_backend)
    mlp = (moe, gpt_oss_mlp_mappings) if spec.is_moe else (llama_mlp, llama_mlp_mappings)
    runner = ModelRunner(spec, state, *mlp, s_max=s_max, dtype=dtype, backend=attn_backend)
    runner.load(SafetensorsCheckpoint(ckpt), pipelined=pipelined)
    out = {"graphs": runner.warmup() if warmup else None}
    seqs = prompts(spec.vocab)[:sequences]
    b_local = -(-len(seqs) // cfg.dp_size)
    replica = rank // cfg.tp_size
    mine = seqs[replica * b_local:(replica + 1) * b_local]
    first, pre_logits = [], []
    for slot, ids in enumerate(mine):
        tok, logits = runner.prefill(slot, ids, return_logits=True)
        first.append(tok)
        pre_logits.append(logits)
    cur = torch.cat(first)
    positions = torch.tensor([len(s) for s in mine])
    tokens, logits, layer_log, step_log = [cur], [torch.cat(pre_logits)], None, None
    for step in range(steps):
        marks = {}

        def hook(i, where, marks=marks):
            if i == 0:
                marks[where] = len(state.log.records)

        start = len(state.log.records)
        cur, lg = runner.decode(cur, positions, flow=flow, return_logits=True,
                                layer_hook=hook if step == log_layer_step else None)
        end = len(state.log.records)
        if step == log_layer_step:
            layer_log = [(r.op, r.group) for r in state.log.records[marks["start"]:marks["end"]] if not r.bypassed]
            step_log = [(r.op, r.group) for r in state.log.records[start:end] if not r.bypassed]
        tokens.append(cur)
        logits.append(lg)
        positions = positions + 1
    out.update(replica=replica, tokens=torch.stack(tokens), logits=torch.stack(logits), layer_log=layer_log,
               step_log=step_log,
               groups={k: getattr(state, k).tp.name for k in ("attention", "mlp", "embedding", "lm_head")}
               | {k + "_dp": getattr(state, k).dp.name for k in ("attention", "mlp", "embedding", "lm_head")}
               | {"tp": state.tp.name})
    return out


def by_replica(results, tp_size):
    """Concatenate replicas' [steps+1, B_local(, V)] results along the batch; check every rank of a replica agrees."""
    reps = {}
    for r in results:
        first = reps.setdefault(r["replica"], r)
        assert torch.equal(first["tokens"], r["tokens"]), "ranks of one replica disagree on tokens"
        assert torch.allclose(first["logits"], r["logits"], atol=1e-5), "ranks of one replica disagree on logits"
    order = sorted(reps)
    return (torch.cat([reps[d]["tokens"] for d in order], dim=1), torch.cat([reps[d]["logits"] for d in order], dim=1))
