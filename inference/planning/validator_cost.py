"""What verifying a model costs a validator that holds none of it: one block check and one whole-model audit.

    python -m inference.planning.validator_cost --model kimi_k3 --memory-gb 64 --disk-gbps 5 --tokens 2048

A validator's block reference (inference/swarm/block_reference.py) re-runs one block of layers at a time in fp32
on its CPU, reading from the checkpoint on disk each layer's own tensors and, of each MoE layer, the routed
experts its tokens pick, and holds at most its memory budget of them (inference/model/lazy.py). The sizes here
are that code's (`inference.model.lazy.site_bytes`: what each layer, expert, the embedding and the head take on
disk and held); what is assumed is said:

- tokens pick experts uniformly and independently: a MoE layer over T tokens touches
  E x (1 - (1 - k/E)^T) distinct experts (real routing is skewed, so fewer);
- a check reads everything it touches once (a cold reference; a warm one reads less), at `disk` bytes/s,
  decodes each MXFP4 expert it runs once (a prefill re-runs each layer once) at `decode` weights/s, and computes
  2 x active parameters x tokens FLOPs at `cpu` FLOP/s (attention's T^2 terms left out), one after the other;
- **a block check** (a stage check) re-runs a block of `stage_layers` layers over T tokens;
- **a whole-model audit** (an opening of a committed answer, scoring/openings.py) re-runs one committed block
  (`commit_layers` layers; Kimi K3's default is 4) over the answer's T positions, reads the embedding (the
  inputs' first block sum) and computes the head at 16 positions, and receives the opened states:
  (block starts below it + 2) x T x D fp32 values.

Both are set next to the checked miner's compute for the same tokens (2 x active parameters x T over the block
or the whole model).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from inference.model.config import ModelConfig
from inference.model.lazy import site_bytes

HEAD_ROWS = 16  # scoring.openings.HEAD_ROWS (inference/ may not import scoring)


@dataclass(frozen=True)
class ValidatorMachine:
    memory_bytes: int  # what the block reference may hold
    disk_bytes_per_s: float
    cpu_flops: float  # fp32 FLOP/s the reference's matmuls reach
    decode_weights_per_s: float  # MXFP4 expert weights decoded per second (inference.model.mxfp4.dequantize)


@dataclass
class CheckEstimate:
    what: str
    layers: tuple[int, int]
    tokens: int
    bytes_read: int
    held_bytes: int  # the most the reference holds (bounded by its budget)
    working_set_bytes: int  # the least it must hold at once
    flops: float
    miner_flops: float  # the checked miner's compute for the same tokens
    received_bytes: int = 0
    decoded_weights: float = 0.0
    disk_s: float = 0.0
    cpu_s: float = 0.0
    decode_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.disk_s + self.decode_s + self.cpu_s

    @property
    def share(self) -> float:
        return self.flops / self.miner_flops if self.miner_flops else 0.0


def experts_touched(config: ModelConfig, tokens: int) -> float:
    """Expected distinct routed experts of one MoE layer over `tokens` tokens (uniform, independent routing)."""
    E, k = config.num_experts, config.experts_per_token
    return E * (1.0 - (1.0 - k / E) ** tokens)


def _active_params(config: ModelConfig, layer: int) -> float:
    """Per-token active parameters of one layer (scoring.stage_rewards.active_params_per_layer's rule)."""
    D = config.hidden_size
    kda_bf16, kda_fp32 = config._kda_params()
    attention = config._mla_params() if config.is_mla(layer) else kda_bf16 + kda_fp32 - config.a_log_size \
        + config.kda_heads
    mlp = (config._moe_dense_params()[0] + config.experts_per_token * config._expert_params()) if config.is_moe(layer) \
        else 3 * D * config.dense_intermediate_size
    return float(config._layer_common_params() + attention + mlp)


def _decoded(config: ModelConfig, start: int, stop: int, tokens: int) -> float:
    """MXFP4 weights decoded re-running layers [start, stop) once over `tokens` tokens."""
    moe = sum(1 for i in range(start, stop) if config.is_moe(i))
    return moe * experts_touched(config, tokens) * config._expert_params() if config.mxfp4_experts else 0.0


def _block(config: ModelConfig, start: int, stop: int, tokens: int, stored, held):
    """(bytes read, bytes held, one layer's working set) of layers [start, stop) over `tokens` tokens."""
    read = hold = work = 0.0
    for i in range(start, stop):
        dense_s, dense_h = stored[("layer", i)], held[("layer", i)]
        expert_s = stored.get(("expert", i, 0), 0)
        expert_h = held.get(("expert", i, 0), 0)
        n = experts_touched(config, tokens) if config.is_moe(i) else 0.0
        read += dense_s + n * expert_s
        hold += dense_h + n * expert_h
        work = max(work, dense_h + expert_h)
    return read, hold, work


def block_check(config: ModelConfig, start: int, stop: int, tokens: int, machine: ValidatorMachine,
                stored=None, held=None) -> CheckEstimate:
    """A stage check: layers [start, stop) re-run over `tokens` tokens (the embedding or head with the block)."""
    if stored is None:
        stored, held = site_bytes(config)
    read, hold, work = _block(config, start, stop, tokens, stored, held)
    flops = 2.0 * tokens * sum(_active_params(config, i) for i in range(start, stop))
    for site, edge in (("embedding", start == 0), ("head", stop == config.num_layers)):
        if edge:
            read += stored[(site,)]
            hold += held[(site,)]
            work = max(work, held[(site,)])
    if stop == config.num_layers:
        flops += 2.0 * tokens * config.hidden_size * config.vocab_size
    est = CheckEstimate("block check", (start, stop), tokens, int(read), int(min(hold, machine.memory_bytes)),
                        int(work), flops, flops, decoded_weights=_decoded(config, start, stop, tokens))
    return _timed(est, machine)


def whole_model_audit(config: ModelConfig, commit_layers: int, tokens: int, machine: ValidatorMachine,
                      stored=None, held=None) -> CheckEstimate:
    """An opening of one committed block of a whole-model miner's answer of `tokens` positions: the deepest whole
    block of `commit_layers` layers (the most opened states to receive), the embedding, the head at HEAD_ROWS
    positions."""
    if stored is None:
        stored, held = site_bytes(config)
    L = config.num_layers
    start = ((L - commit_layers) // commit_layers) * commit_layers
    stop = start + commit_layers
    read, hold, work = _block(config, start, stop, tokens, stored, held)
    read += stored[("embedding",)] + stored[("head",)]
    hold += held[("embedding",)] + held[("head",)]
    work = max(work, held[("embedding",)], held[("head",)])
    total = sum(_active_params(config, i) for i in range(L))
    flops = 2.0 * tokens * sum(_active_params(config, i) for i in range(start, stop)) \
        + 2.0 * HEAD_ROWS * config.hidden_size * config.vocab_size
    miner = 2.0 * tokens * (total + config.hidden_size * config.vocab_size)
    sources = len(range(config.attn_res_block_size, start, config.attn_res_block_size)) + 2  # block sums, in, out
    received = sources * tokens * config.hidden_size * 4
    est = CheckEstimate("whole-model audit (one opening)", (start, stop), tokens, int(read),
                        int(min(hold, machine.memory_bytes)), int(work), flops, miner, received,
                        decoded_weights=_decoded(config, start, stop, tokens))
    return _timed(est, machine)


def _timed(est: CheckEstimate, machine: ValidatorMachine) -> CheckEstimate:
    est.disk_s = est.bytes_read / machine.disk_bytes_per_s
    est.cpu_s = est.flops / machine.cpu_flops
    est.decode_s = est.decoded_weights / machine.decode_weights_per_s
    return est


def report(config: ModelConfig, machine: ValidatorMachine, tokens: int, stage_layers: int,
           commit_layers: int) -> str:
    stored, held = site_bytes(config)
    mid = (config.num_layers // 2 // stage_layers) * stage_layers
    rows = [block_check(config, mid, min(config.num_layers, mid + stage_layers), tokens, machine, stored, held),
            whole_model_audit(config, commit_layers, tokens, machine, stored, held)]
    lines = [f"{config.model_id}: checkpoint {sum(stored.values()) / 1e12:.3f} TB; validator: "
             f"{machine.memory_bytes / 1e9:.0f} GB for weights, disk {machine.disk_bytes_per_s / 1e9:g} GB/s, "
             f"CPU {machine.cpu_flops / 1e9:g} GFLOP/s fp32, MXFP4 decode "
             f"{machine.decode_weights_per_s / 1e9:g} G weights/s; {tokens} tokens; experts touched per MoE layer "
             f"{experts_touched(config, tokens):.0f} of {config.num_experts}",
             "",
             "| check | layers | weights read GB | held GB (<= budget) | one layer at once GB | states received GB | "
             "disk s | decode s | matmul s | total s | validator TFLOP | miner TFLOP (same tokens) | share |",
             "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| {r.what} | {r.layers[0]}-{r.layers[1] - 1} | {r.bytes_read / 1e9:.1f} | "
                     f"{r.held_bytes / 1e9:.1f} | {r.working_set_bytes / 1e9:.2f} | {r.received_bytes / 1e9:.2f} | "
                     f"{r.disk_s:.1f} | {r.decode_s:.1f} | {r.cpu_s:.1f} | {r.seconds:.1f} | {r.flops / 1e12:.1f} | "
                     f"{r.miner_flops / 1e12:.1f} | {r.share:.1%} |")
    fits = max(r.working_set_bytes for r in rows) <= machine.memory_bytes
    lines.append("")
    lines.append(f"one layer's working set {'fits' if fits else 'does NOT fit'} the budget; a stage check of a block "
                 f"larger than the budget re-reads evicted experts at every step of the session (not counted above)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inference.planning.validator_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="kimi_k3", help="a ModelConfig preset")
    p.add_argument("--memory-gb", type=float, default=64.0, help="the machine's memory (the reference gets 75%%)")
    p.add_argument("--disk-gbps", type=float, default=5.0, help="one NVMe disk's sustained read, GB/s")
    p.add_argument("--cpu-gflops", type=float, default=500.0, help="fp32 GFLOP/s of the validator's CPU matmuls")
    p.add_argument("--decode-gweights", type=float, default=0.75,
                   help="MXFP4 weights decoded per second, in billions (the project's decoder runs ~25 M/s per core)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the checked session or answer")
    p.add_argument("--stage-layers", type=int, default=12, help="layers of the checked stage's block")
    p.add_argument("--commit-layers", type=int, default=4, help="layers per committed block")
    args = p.parse_args(argv)
    config = ModelConfig.preset(args.model)
    machine = ValidatorMachine(int(args.memory_gb * 0.75 * 1e9), args.disk_gbps * 1e9, args.cpu_gflops * 1e9,
                               args.decode_gweights * 1e9)
    print(report(config, machine, args.tokens, args.stage_layers, args.commit_layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
