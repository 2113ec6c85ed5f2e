"""Make the small Llama that the real-vLLM contract tests serve (run it in .venv-vllm).

    .venv-vllm/bin/python scripts/make_tiny_llama.py OUT_DIR [--seed 0]

vLLM's Kimi K3 model code is GPU-only, so on a CPU the tests serve a small Llama instead: what is
under test is the HTTP contract (token ids, logprobs, seeds, stops, aborts, prompt logprobs), not
the model. Shape: hidden 256, 4 heads of dim 64 (vLLM's CPU attention needs head_dim 64; 16 fails),
2 layers, vocab 512, random weights saved with `transformers`. The tokenizer is a byte-level BPE
trained with `tokenizers` on text of this machine's Python standard library, with the special
tokens of the project's chat format ([BOS], [EOS], [PAD] and the <|im_*|> role tokens), so the
miner's own tokenizer code (inference/model/hf_tokenizer.py) reads it like a release's.

This file stands alone (it imports nothing from the project) because it runs in the vLLM venv.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["[BOS]", "[EOS]", "[PAD]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                  "<|im_middle|>", "<|im_end|>"]


def training_text() -> list[str]:
    """Local text, the same on every machine with this Python: some standard library sources."""
    import argparse as a
    import json as j
    import pathlib as p
    import textwrap as t

    return [Path(m.__file__).read_text() for m in (a, j.decoder, j.encoder, p, t)]


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"the trained vocabulary has {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    tok.save(str(out / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
        "add_bos_token": False, "model_max_length": 8192,
        "added_tokens_decoder": {str(i): {"content": name, "special": True} for name, i in ids.items()},
    }, indent=1))
    return ids


def make_model(out: Path, ids: dict, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
                         bos_token_id=ids["[BOS]"], eos_token_id=ids["[EOS]"], pad_token_id=ids["[PAD]"],
                         tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a sharper output distribution than the default init gives: distinct top tokens
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size="1MB")
    (out / "generation_config.json").unlink(missing_ok=True)  # sampling defaults come from each request


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ids = make_tokenizer(args.out)
    make_model(args.out, ids, args.seed)
    print(f"tiny Llama written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
