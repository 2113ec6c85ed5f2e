"""Training the tiny K3: the differentiable KDA prefill against the recurrence, the training forward against the
inference forward, gradients reaching every part, bit-identical re-runs, and the shipped trained checkpoint."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_kda import kernel_inputs

from inference.model import mxfp4, training
from inference.model.checkpoint import fingerprint, read_manifest, verify_manifest
from inference.model.config import ModelConfig
from inference.model.k3 import KimiK3Model
from inference.model.kda import KDAAttention, kda_chunked_autograd, kda_recurrent
from inference.model.tokenizer import ByteTokenizer
from inference.model.training import (TrainConfig, bits_per_byte, heldout_windows, load_model, make_trainable,
                                      random_model, release_state_dict, stdlib_corpus, train, train_model,
                                      training_logits, unigram_bits_per_byte)

ASSET = Path(__file__).resolve().parents[1] / "inference" / "model" / "assets" / "tiny_trained"


# ------------------------------------------------------------------------------ differentiable KDA
@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "strong"])
@pytest.mark.parametrize("T", [1, 15, 16, 40])
def test_autograd_kernel_equals_recurrence_and_its_gradients(T, gate):
    inputs = kernel_inputs(T=T, gate=gate, dtype=torch.float64)
    outs = []
    for kernel in (kda_recurrent, kda_chunked_autograd):
        leaves = [t.clone().requires_grad_() for t in inputs]
        q, k, v, g, beta, state = leaves
        o, s = kernel(q, k, v, g, beta, initial_state=state)
        (o.sin().sum() + s.cos().sum()).backward()
        outs.append((o.detach(), s.detach(), [t.grad for t in leaves]))
    (o_ref, s_ref, grads_ref), (o, s, grads) = outs
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-10, rtol=0)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


def test_autograd_kernel_refuses_spans_that_could_overflow():
    q, k, v, g, beta, _ = kernel_inputs(T=64, gate="strong")
    with pytest.raises(ValueError, match="smaller chunk_size"):
        kda_chunked_autograd(q, k, v, g, beta, chunk_size=64)  # 32 steps of about -5 from the middle row


def test_layer_training_prefill_matches_inference_prefill():
    config = ModelConfig.tiny()
    torch.manual_seed(0)
    layer = KDAAttention(config)
    x = torch.randn(70, config.hidden_size)
    with torch.inference_mode():
        want = layer(x, layer.new_cache())
    layer.differentiable_prefill = True
    xg = x.clone().requires_grad_()
    got = layer(xg, layer.new_cache())
    torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=1e-4)
    got.square().sum().backward()
    assert xg.grad is not None and xg.grad.abs().sum() > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


# ------------------------------------------------------------------------------ training forward
def _trained_like(fake_quant=True):
    config = training.trained_tiny_config()
    model = make_trainable(config, seed=3, fake_quant=fake_quant)
    with torch.no_grad():  # move the weights off their init so the check is not about a special point
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.std().clamp(min=1e-3))
    return config, model


def test_training_forward_equals_the_inference_forward_of_the_released_weights():
    config, model = _trained_like()
    ids = torch.randint(0, 256, (2, 45), generator=torch.Generator().manual_seed(0))
    got = training_logits(model, ids).detach()
    served = KimiK3Model(config, random_init=False)
    missing = served.load_state_dict(release_state_dict(model), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    want = served.forward(list(ids), [served.new_cache(), served.new_cache()], all_logits=True)
    for b in range(2):
        torch.testing.assert_close(got[b], want[b], atol=2e-4, rtol=1e-4)


def test_fake_quantised_experts_forward_on_the_mxfp4_grid():
    _, model = _trained_like(fake_quant=True)
    expert = model.layers[1].block_sparse_moe.experts[0]
    z = torch.randn(5, expert.w1.in_features)
    on_grid = mxfp4.dequantize(*mxfp4.quantize(expert.w1.weight.detach()))
    torch.testing.assert_close(expert.w1(z), z @ on_grid.T)
    assert not torch.equal(on_grid, expert.w1.weight.detach())  # the float weight itself is off the grid


def test_gradients_reach_every_part_of_the_network():
    _, model = _trained_like()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    logits = training_logits(model, ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    unrouted = [n for n, g in grads.items() if g is None]
    assert all(".experts." in n or n.startswith("model.layers.0.self_attention_res") for n in unrouted)
    grads = {n: g for n, g in grads.items() if g is not None}
    assert all(torch.isfinite(g).all() for g in grads.values())
    for part in ("self_attn.q_proj", "self_attn.A_log", "self_attn.dt_bias", "q_conv1d", "kv_b_proj",
                 "q_a_proj", "gate.weight", "routed_expert_down_proj", "experts.", "shared_experts",
                 "mlp_res_proj", "self_attention_res_proj", "output_attn_res_proj", "embed_tokens", "lm_head"):
        assert any(part in n and g.abs().sum() > 0 for n, g in grads.items()), part
    # Layer 0's attention-side AttnRes site never runs (no completed block exists yet), in inference too.
    unused = {"model.layers.0.self_attention_res_proj.weight", "model.layers.0.self_attention_res_norm.weight"}
    silent = [n for n, g in grads.items() if g.abs().sum() == 0 and ".experts." not in n]
    assert not silent and unused <= set(unrouted)


# ------------------------------------------------------------------------------ determinism
@pytest.fixture(scope="module")
def small_stdlib(tmp_path_factory):
    """A few stdlib files (with at least one held out) so that a short run reads little text."""
    root = training.stdlib_root()
    out = tmp_path_factory.mktemp("stdlib")
    picked, held = 0, 0
    for path in sorted(root.glob("*.py")):
        if training.is_heldout(path.name):
            if held >= 2:
                continue
            held += 1
        elif picked >= 12:
            continue
        else:
            picked += 1
        shutil.copy(path, out / path.name)
        if picked >= 12 and held >= 1:
            break
    return out


def _short(stdlib_dir, **changes):
    base = dict(steps=3, batch_size=2, seq_len=48, warmup_steps=1, threads=1, stdlib_dir=str(stdlib_dir),
                eval_bytes=480)
    base.update(changes)
    return TrainConfig(**base)


def test_two_runs_with_one_seed_give_identical_weights_and_checkpoints(small_stdlib, tmp_path):
    infos = [train(_short(small_stdlib), tmp_path / f"run{i}", log=None) for i in range(2)]
    assert infos[0]["fingerprint"] == infos[1]["fingerprint"] == fingerprint(tmp_path / "run0")
    a = load_model(tmp_path / "run0").state_dict()
    b = load_model(tmp_path / "run1").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other, _ = train_model(_short(small_stdlib, seed=1), log=None)
    assert not torch.equal(other.lm_head.weight, load_model(tmp_path / "run0").lm_head.weight)
    verify_manifest(tmp_path / "run0")
    assert json.loads((tmp_path / "run0" / training.INFO_FILE).read_text())["train_config"]["seed"] == 0


def test_stdlib_split_is_by_path_and_disjoint(small_stdlib):
    corpus = stdlib_corpus(small_stdlib)
    assert corpus.train_files >= 1 and corpus.heldout_files >= 1
    assert corpus.train.find(corpus.heldout[:200]) == -1
    assert stdlib_corpus(small_stdlib).fingerprint == corpus.fingerprint


# ------------------------------------------------------------------------------ the shipped checkpoint
def test_shipped_checkpoint_loads_with_its_fingerprint_and_beats_the_baselines():
    manifest = verify_manifest(ASSET)
    info = json.loads((ASSET / training.INFO_FILE).read_text())
    assert manifest["fingerprint"] == fingerprint(ASSET) == info["fingerprint"] == read_manifest(ASSET)["fingerprint"]
    model = load_model(ASSET)
    assert model.config == training.trained_tiny_config() and model.config.mxfp4_experts
    corpus = stdlib_corpus()
    windows = heldout_windows(corpus, 2048, 256)
    trained = bits_per_byte(model, windows)
    unigram = unigram_bits_per_byte(corpus.train, windows)
    random = bits_per_byte(random_model(model.config), windows)
    assert trained < unigram - 0.5 and trained < random - 3, (trained, unigram, random)
    assert ByteTokenizer.from_config(model.config).decode(model.forward(
        [torch.tensor(list(b"def "))], [model.new_cache()])[0].topk(1).indices.tolist())


# ------------------------------------------------------------------------------ the probe-task recipe
def _task_rows(small_stdlib, steps=(0,), **changes):
    tc = _short(small_stdlib, **{"batch_size": 6, "seq_len": 256, "task_fraction": 1.0, "answer_weight": 7.0,
                                 "repeat_steps": 0, "repeat_share": 0.0, "pack_tasks": False, "max_distractors": 2,
                                 "fact_doc_bytes": 0, **changes})
    tokenizer = ByteTokenizer.from_config(tc.model_config())
    batches = training.Batches(stdlib_corpus(small_stdlib), tc, tokenizer)
    return tokenizer, [batches.next(step) for step in steps], batches


def _answers(tokenizer, ids, weights):
    """The text of each run of heavy-weighted targets, per row."""
    out = []
    for row, w in zip(ids, weights):
        runs, current = [], []
        for target, weight in zip(row[1:].tolist(), w.tolist()):
            if weight > 1:
                current.append(target)
            elif current:
                runs.append(tokenizer.decode(current))
                current = []
        if current:
            runs.append(tokenizer.decode(current))
        out.append(runs)
    return out


def test_answer_weights_cover_exactly_each_answer(small_stdlib):
    tokenizer, [(ids, weights)], _ = _task_rows(small_stdlib, copy_share=0.5, random_copy_share=0.5)
    assert set(weights.unique().tolist()) == {1.0, 7.0}
    for row, runs in zip(ids, _answers(tokenizer, ids, weights)):
        text = tokenizer.decode(row.tolist())
        assert len(runs) == 1 and runs[0].endswith("<|im_end|>")
        answer = runs[0][: -len("<|im_end|>")]
        prompt = text[: text.index("<|im_assistant|>")]
        assert answer in prompt  # a planted code or the text to repeat, both in the prompt
        if "access code" in prompt:
            assert f"The access code for {prompt.rsplit('access code for ', 1)[1].split('?')[0]} is {answer}." in prompt


def test_packed_task_rows_hold_several_answered_exchanges(small_stdlib):
    tokenizer, [(ids, weights)], _ = _task_rows(small_stdlib, pack_tasks=True, curriculum_steps=1000, copy_share=0.0,
                                                seq_len=400)  # no filler yet: an exchange is about 150 bytes
    runs = _answers(tokenizer, ids, weights)
    assert all(len(r) >= 2 for r in runs), runs
    assert all(tokenizer.decode(row.tolist()).count("<|im_user|>") >= 2 for row in ids)


def test_curriculum_grows_the_filler_around_the_fact(small_stdlib):
    _, _, batches = _task_rows(small_stdlib, fact_doc_bytes=120, curriculum_steps=100)
    assert [batches.fact_doc_limit(s) for s in (0, 50, 100, 500)] == [0, 60, 120, 120]
    tokenizer, [(ids, _)], _ = _task_rows(small_stdlib, fact_doc_bytes=120, curriculum_steps=100, copy_share=0.0)
    for row in ids:  # at step 0 the fact comes right before the question
        content = tokenizer.decode(row.tolist()).split("<|im_middle|>", 1)[1]
        assert content.startswith("The access code for ") and "\n\nWhat is the access code for " in content


def _repeat_units(row: list[int]) -> list[tuple[bytes, bytes]]:
    """(string, text after it) for each OPEN string CLOSE unit of a repeat row."""
    data = bytes(row)
    out = []
    for part in data.split(bytes([training.REPEAT_OPEN]))[1:]:
        if bytes([training.REPEAT_CLOSE]) in part:
            string, rest = part.split(bytes([training.REPEAT_CLOSE]), 1)
            out.append((string, rest))
    return out


def test_repeat_rows_say_each_string_twice_with_stdlib_text_between(small_stdlib):
    tokenizer, [(ids, weights)], batches = _task_rows(small_stdlib, repeat_steps=5, repeat_gap=80,
                                                      repeat_gap_steps=10)
    assert [batches.repeat_gap_limit(s) for s in (0, 4, 9, 50)] == [8, 40, 80, 80]
    corpus = batches.text
    strings_seen = 0
    for row in ids.tolist():  # every row at a step below repeat_steps is a repeat row
        units = _repeat_units(row)
        assert len(units) >= 2
        for (first, gap), (second, _) in zip(units[0::2], units[1::2]):  # a string, then the same one again
            if not second or len(second) < len(first):
                continue  # the row ended inside the repeat
            assert first == second and 6 <= len(first) <= 16
            assert first.isdigit() or first.isalnum()
            assert len(gap) <= 8 and (not gap or gap in corpus)  # at step 0 the gap is at most 8 bytes
            strings_seen += 1
    assert strings_seen >= 6 and torch.equal(weights, torch.ones_like(weights))
    _, [(later, _)], _ = _task_rows(small_stdlib, steps=(7,), repeat_steps=0, repeat_share=0.0)
    assert all(training.REPEAT_OPEN not in row for row in later.tolist())  # after them, no share: no repeat rows


def test_random_copy_passages_are_codes_and_names_only():
    rng = __import__("random").Random(3)
    for _ in range(50):
        passage = training.random_passage(rng, 40)
        assert len(passage) == 40
        assert all(w.isdigit() or w.isalpha() for w in passage.split(" ") if w)


def test_the_weighted_loss_trains_deterministically(small_stdlib):
    changes = dict(task_fraction=1.0, answer_weight=5.0, pack_tasks=True, random_copy_share=0.5,
                   fact_doc_bytes=8, seq_len=200, repeat_steps=0, repeat_share=0.0)  # task rows; answers fit
    a, _ = train_model(_short(small_stdlib, **changes), log=None)
    b, _ = train_model(_short(small_stdlib, **changes), log=None)
    plain, _ = train_model(_short(small_stdlib, **{**changes, "answer_weight": 1.0}), log=None)
    sa, sb, sp = a.state_dict(), b.state_dict(), plain.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sp[k]) for k in sa)  # the weights change what is learnt


@pytest.mark.parametrize("preset", ["tiny_trained", "tiny_kimi_linear"])
def test_kda_decay_init_puts_each_head_on_the_ladder(preset):
    config = ModelConfig.preset(preset)
    plain = make_trainable(config, seed=0, fake_quant=False)
    laddered = make_trainable(config, seed=0, fake_quant=False, decay_init=(0.01, 1.0))
    for before, after in zip(plain.modules(), laddered.modules()):
        if not isinstance(after, KDAAttention):
            continue
        H, d = after.num_heads, after.head_dim
        nats = -after.log_decay(torch.zeros(H, d)).detach().double()  # decay at zero gate input, per token
        assert nats.min().item() == pytest.approx(0.01, rel=1e-4)  # the layer spans 0.01 .. 1.0 nats a token
        assert nats.max().item() == pytest.approx(1.0, rel=1e-4)
        for head in nats:  # interleaved: each head holds slow and fast channels
            assert head.min() < 0.013 and head.max() > 0.75
        torch.testing.assert_close(after.A_log, before.A_log)  # only dt_bias moves
        assert (-before.log_decay(torch.zeros(H, d))).median() > 0.5  # the model's own init forgets far faster


def test_recall_init_starts_context_free_with_kda_as_a_next_token_memory():
    config = ModelConfig.preset("tiny_trained")
    recall = make_trainable(config, seed=0, fake_quant=False, recall_init=True)
    plain = make_trainable(config, seed=0, fake_quant=False)

    def last_logits(model, text):
        with torch.no_grad():
            return model.forward([torch.tensor(list(text))], [model.new_cache()])[0]

    # every branch into the residual stream starts at zero: the next byte depends on the last byte alone...
    torch.testing.assert_close(last_logits(recall, b"import os\nx"), last_logits(recall, b"01234 zz x"))
    assert not torch.allclose(last_logits(plain, b"import os\nx"), last_logits(plain, b"01234 zz x"))
    # ...and each KDA layer is set up to store "the token after this one" and look it up from the current token
    kda = [m for m in recall.modules() if isinstance(m, KDAAttention)]
    assert kda
    for m in kda:
        taps = m.k_conv1d.weight.shape[-1]
        for conv, lag in ((m.q_conv1d, 0), (m.k_conv1d, 1), (m.v_conv1d, 0)):
            expected = torch.zeros_like(conv.weight)
            expected[:, 0, taps - 1 - lag] = 1.0
            assert torch.equal(conv.weight, expected)
        assert torch.equal(m.k_proj.weight, m.q_proj.weight) and not m.f_b_proj.weight.any()
    assert recall.model.embed_tokens.weight.std() < 0.5 * plain.model.embed_tokens.weight.std()
