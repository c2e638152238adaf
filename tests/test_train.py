"""Drafter training: the training forward equals drafting, the loss falls, and a SIGKILLed run resumes exactly."""
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.kernels import cpu as cpu_kernel
from jaxspec.segment import Segment
from jaxspec.train.data import Dataset, compute_taps, frequent_tokens
from jaxspec.train.trainer import TrainConfig, block_loss, train
from test_engine import PROMPT, tiny_target

pytestmark = pytest.mark.optimized  # real models and training: running outweighs compiling


def tiny_data(model, n=12, S=48):
    """Greedy continuations of random prompts: the self-distillation recipe in miniature."""
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 128, 8).tolist() for _ in range(n)]
    outs = jaxspec.generate(model, input_ids=prompts, max_new_tokens=S - 8).token_ids
    tokens, mask, lengths = np.zeros((n, S), np.int32), np.zeros((n, S), bool), np.zeros(n, np.int32)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        tokens[i, : len(p) + len(o)], mask[i, len(p) : len(p) + len(o)], lengths[i] = p + o, True, len(p) + len(o)
    return Dataset(tokens, mask, lengths), prompts


@pytest.mark.parametrize("vocab", [(), tuple(range(1, 128, 2))])
def test_train_forward_matches_drafting(vocab):
    """A block at anchor a in training sees exactly what the drafter sees at committed length a (drafting reads
    its cache through the CPU attention kernel where there is one: two independent forms of the same sums)."""
    m = tiny_target("llama")
    d = jaxspec.init_drafter(m, num_layers=2, block_size=8, seed=2, draft_vocab=vocab)
    seq = jnp.asarray([PROMPT + PROMPT[:7]])  # [1, 20]
    taps, _ = compute_taps(m, Dataset(np.asarray(seq), np.ones(seq.shape, bool), np.array([20])),
                           d.config.target_layer_ids)
    anchors = jnp.asarray([[5, 11]])
    block = jnp.where(jnp.arange(8) == 0, seq[0, anchors[0]][:, None], d.config.mask_token_id)[None]  # [1, 2, 8]
    tgt, dm = m.module, d.module
    h_train = dm.train_forward(jnp.asarray(taps), tgt.embed(block), anchors)
    for j, a in enumerate([5, 11]):
        cache = dm.append_context(dm.init_cache(1, 32), jnp.asarray(taps[:, :a]), a)
        draft = jax.jit(lambda c, n: dm.draft_logits(tgt, c, seq[0, n], n)[0])
        want = np.asarray(draft(cache, jnp.asarray([a])))  # [Bk-1, K]
        assert (cpu_kernel.ATTENTION in draft.lower(cache, jnp.asarray([a])).as_text()) == (cpu_kernel.level() == 2)
        np.testing.assert_allclose(np.asarray(dm.head(tgt, h_train[0, j, 1:])), want, atol=1e-4)


def ragged_data(model, n=5, S=96):
    """tiny_data with rows of different lengths and answer starts, some past one TAPS_BUCKET."""
    data, _ = tiny_data(model, n=n, S=S)
    for i in range(n):
        data.lengths[i] = S - 11 * i
        data.tokens[i, data.lengths[i] :] = 0
        data.loss_mask[i] = (np.arange(S) >= 8 + 4 * i) & (np.arange(S) < data.lengths[i])
    return data


@pytest.mark.parametrize("on_disk", [False, True])
def test_taps_are_a_full_forwards(on_disk, tmp_path):
    """Rows sorted by length and cut to their batch's longest: the taps of a plain full-length forward up to
    each row's length, zero past it; also when filling a given array on disk that starts out as garbage."""
    m = tiny_target("qwen3")
    data = ragged_data(m)
    N, S = data.tokens.shape
    out = None
    if on_disk:
        out = np.lib.format.open_memmap(tmp_path / "taps.npy", mode="w+", dtype=np.float32,
                                        shape=(N, S, 2 * m.config.hidden_size))
        out[:] = np.nan
    taps, _ = compute_taps(m, data, (0, 1), batch=2, out=out)  # 5 rows: the last batch is padded
    assert out is None or taps is out
    pos = jnp.broadcast_to(jnp.arange(S), (N, S))
    _, want, _ = m.module(jnp.asarray(data.tokens), Segment.causal(pos), m.module.init_cache(N, S), tap_layers=(0, 1),
                          logits_idx=jnp.zeros((N, 1), jnp.int32))
    inside = np.arange(S) < data.lengths[:, None]  # [N, S]
    want = np.asarray(want)[inside]  # hidden states reach ~200: float32 noise from other shapes is ~1e-3
    np.testing.assert_allclose(taps[inside], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not taps[~inside].any()


def test_soft_labels_are_the_targets_next_token_distribution():
    """compute_taps' soft labels at position t: the SOFT_K most likely tokens after x_0..x_t and their
    probabilities, as a plain full-sequence forward (model.logits) gives them, wherever x_{t+1} is a training
    target; zero elsewhere."""
    from jaxspec.train.data import SOFT_K

    m = tiny_target("qwen3")
    data = ragged_data(m)
    _, (ids, probs) = compute_taps(m, data, (1,), soft=True, batch=2)
    need = np.zeros_like(data.loss_mask)
    need[:, :-1] = data.loss_mask[:, 1:]
    p = np.asarray(jax.nn.softmax(m.logits(jnp.asarray(data.tokens)), axis=-1))[need]  # [M, V]
    want = np.sort(p, axis=-1)[..., ::-1][..., :SOFT_K]
    np.testing.assert_allclose(probs[need], want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.take_along_axis(p, ids[need], -1), probs[need], rtol=1e-4, atol=1e-6)
    assert not probs[~need].any() and not ids[~need].any()


@pytest.mark.parametrize("vocab", [(), tuple(range(0, 128, 2))])
def test_one_hot_soft_labels_give_the_hard_loss(vocab):
    """Soft labels that put all mass on the data's next token (x_{t+1} after position t) give exactly the
    hard-label loss: slot k of a block at anchor a must read the distribution after x_{a+k-1}."""
    m = tiny_target("qwen3")
    data, _ = tiny_data(m, n=4)
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, draft_vocab=vocab)
    taps, _ = compute_taps(m, data, d.config.target_layer_ids)
    ids = np.zeros(data.tokens.shape + (3,), np.int32)
    ids[:, :-1, 0], ids[:, :, 1:] = data.tokens[:, 1:], 5  # other ids with zero probability
    probs = np.zeros(ids.shape, np.float32)
    probs[..., 0] = 1.0
    anchors = jnp.asarray(np.random.RandomState(1).randint(8, 45, (4, 6)))
    args = (m.module, d.module, jnp.asarray(taps), jnp.asarray(data.tokens), jnp.asarray(data.loss_mask), anchors,
            jnp.ones((4, 6), bool), d.config.mask_token_id, 4.0)
    hard, _ = block_loss(*args)
    soft, _ = block_loss(*args, (jnp.asarray(ids), jnp.asarray(probs)), 1.0)
    np.testing.assert_allclose(float(soft), float(hard), rtol=1e-5)
    five = (jnp.asarray(ids), jnp.asarray(np.roll(probs, 1, axis=-1)))  # all mass on id 5
    only5, _ = block_loss(*args, five, 1.0)
    mixed, _ = block_loss(*args, five, 0.25)
    assert abs(float(only5) - float(hard)) > 0.05
    np.testing.assert_allclose(float(mixed), 0.75 * float(hard) + 0.25 * float(only5), rtol=1e-5)


@pytest.mark.parametrize("steps", [1, 2, 1000])
def test_schedule_warms_up_then_decays(steps):
    """Any --steps >= 1 gets a schedule (a 1-step run once crashed optax's cosine decay)."""
    import optax

    from jaxspec.train.trainer import make_optimizer

    p = {"w": jnp.ones(3)}
    opt = make_optimizer(TrainConfig(steps=steps, lr=1e-2))
    state = opt.init(p)
    for _ in range(min(steps, 3)):
        u, state = opt.update({"w": jnp.ones(3)}, state, p)
        p = optax.apply_updates(p, u)
    assert np.isfinite(np.asarray(p["w"])).all()


def test_frequent_tokens():
    tokens = np.array([[5, 5, 5, 7, 7, 9, 1, 1]])
    mask = np.array([[0, 1, 1, 1, 1, 1, 1, 1]], bool)  # the first 5 is prompt: counts 5:2, 7:2, 1:2, 9:1
    data = Dataset(tokens, mask, np.array([8]))
    assert frequent_tokens(data, 2) == (1, 5)  # ties go to the lower id
    assert frequent_tokens(data, 3, always=(0,)) == (0, 1, 5)


@pytest.mark.parametrize("draft_vocab,soft_weight", [(0, 0.0), (64, 0.0), (64, 0.7)])
def test_training_learns(draft_vocab, soft_weight):
    """Loss falls and acceptance rises, also with a draft vocabulary (its label mapping must be right for
    acceptance to rise: verification only accepts the target's own tokens) and with soft labels."""
    m = tiny_target("qwen3")
    data, prompts = tiny_data(m)
    vocab = frequent_tokens(data, draft_vocab) if draft_vocab else ()
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8, draft_vocab=vocab)
    taps, soft = compute_taps(m, data, d.config.target_layer_ids, soft=soft_weight > 0)
    cfg = TrainConfig(steps=150, batch=4, anchors=8, lr=3e-3, ckpt_every=1000, eval_every=1000,
                      soft_weight=soft_weight)
    args = lambda dd: (m.module, dd.module, jnp.asarray(taps[:4]), jnp.asarray(data.tokens[:4]),  # noqa: E731
                       jnp.asarray(data.loss_mask[:4]), jnp.full((4, 4), 10), jnp.ones((4, 4), bool),
                       d.config.mask_token_id, 7.0)
    import tempfile

    trained = train(m, d, data, taps, cfg, ckpt_dir=tempfile.mkdtemp(), soft=soft)
    loss0, _ = block_loss(*args(d))
    loss1, acc1 = block_loss(*args(trained))
    assert float(loss1) < float(loss0) - 1.0 and float(acc1) > 0.3
    before = jaxspec.generate(m, input_ids=prompts[0], drafter=d, budget=8, max_new_tokens=32)
    after = jaxspec.generate(m, input_ids=prompts[0], drafter=trained, budget=8, max_new_tokens=32)
    assert after.token_ids == before.token_ids  # lossless either way
    assert after.stats["acceptance_length"] > before.stats["acceptance_length"] + 0.3


def test_early_stopping_keeps_the_best_evaluation(tmp_path, monkeypatch):
    """Scripted held-out scores 1, 3, 2, 2.5: with patience 2 training stops at the 4th evaluation (step 20)
    and returns the parameters evaluated at step 10, also when the stopped run is resumed."""
    import jaxspec.train.trainer as T

    m = tiny_target("qwen3")
    data, prompts = tiny_data(m)
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8)
    taps, _ = compute_taps(m, data, d.config.target_layer_ids)
    scores, seen = iter([1.0, 3.0, 2.0, 2.5, 9.0]), []

    def fake_al(model, drafter, heldout, max_new_tokens):
        seen.append(jax.tree.map(np.asarray, drafter.params))
        return next(scores)

    monkeypatch.setattr(T, "acceptance_length", fake_al)
    cfg = TrainConfig(steps=40, batch=4, anchors=8, lr=3e-3, ckpt_every=100, eval_every=5, patience=2)
    logs = []
    out = train(m, d, data, taps, cfg, ckpt_dir=tmp_path, heldout=prompts[:1], log=logs.append)
    assert len(seen) == 4  # evaluations at 5, 10, 15, 20, then the stop
    flat = lambda p: np.concatenate([np.ravel(x) for x in jax.tree.leaves(p)])  # noqa: E731
    np.testing.assert_array_equal(flat(out.params), flat(seen[1]))
    assert not np.array_equal(flat(seen[1]), flat(seen[3]))
    again = train(m, d, data, taps, cfg, ckpt_dir=tmp_path, heldout=prompts[:1], log=logs.append)
    assert len(seen) == 4 and "resumed from" in logs[-2] and "step 10" in logs[-1]  # no step was run
    np.testing.assert_array_equal(flat(again.params), flat(seen[1]))


RUN = textwrap.dedent("""
    import os, signal, sys, numpy as np, jax
    sys.path.insert(0, {tests!r})
    import jaxspec
    import jaxspec.train.trainer as T
    from jaxspec.train.data import compute_taps
    from test_train import tiny_data, tiny_target
    kill_at = int(sys.argv[3])
    batch_of_step = T.sample_batch
    def sample_batch(data, step, cfg, block_size):  # SIGKILL ourselves mid-run, between checkpoints
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return batch_of_step(data, step, cfg, block_size)
    T.sample_batch = sample_batch
    m = tiny_target("qwen3")
    data, _ = tiny_data(m)
    d = jaxspec.init_drafter(m, num_layers=1, block_size=8)
    taps, _ = compute_taps(m, data, d.config.target_layer_ids)
    cfg = T.TrainConfig(steps=60, batch=4, anchors=8, lr=3e-3, ckpt_every=10, eval_every=1000)
    out = T.train(m, d, data, taps, cfg, ckpt_dir=sys.argv[1], log=lambda s: print(s, flush=True))
    np.save(sys.argv[2], np.concatenate([np.ravel(x) for x in jax.tree.leaves(out.params)]))
""")


def run_script(tmp_path, ckpt, out, kill_at=-1):
    script = tmp_path / "run.py"
    script.write_text(RUN.format(tests=os.path.dirname(__file__)))
    p = subprocess.run([sys.executable, str(script), str(ckpt), str(out), str(kill_at)], capture_output=True,
                       text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_sigkill_resume_matches_uninterrupted(tmp_path):
    rc, log = run_script(tmp_path, tmp_path / "ck_full", tmp_path / "full.npy")
    assert rc == 0, log
    rc, log = run_script(tmp_path, tmp_path / "ck", tmp_path / "resumed.npy", kill_at=35)
    assert rc == -signal.SIGKILL and not (tmp_path / "resumed.npy").exists(), log
    rc, log = run_script(tmp_path, tmp_path / "ck", tmp_path / "resumed.npy")
    assert rc == 0, log
    assert "at step 30" in log  # resumed from the last checkpoint before the kill, not from scratch
    np.testing.assert_allclose(np.load(tmp_path / "resumed.npy"), np.load(tmp_path / "full.npy"), rtol=1e-5, atol=1e-6)


def test_train_cli_end_to_end(tmp_path, capsys):
    """`python -m jaxspec.train` on a tiny target with a tokenizer: data, training, export, rerun resumes."""
    import json

    from jaxspec.train.__main__ import main
    from test_cli import char_tokenizer, save_tiny

    model_dir = save_tiny(tmp_path / "model")
    char_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hi there", "Count to five", "Say yes"]))

    def argv(steps, prompt_file=prompts, work="work"):
        return ["--model", str(model_dir), "--prompts", str(prompt_file), "--heldout", str(prompts),
                "--out", str(tmp_path / "out"), "--work", str(tmp_path / work), "--steps", str(steps), "--batch", "2",
                "--anchors", "4", "--seq-len", "48", "--num-layers", "1", "--num-taps", "1", "--block-size", "4",
                "--samples", "2", "--ckpt-every", "3", "--eval-every", "6", "--eval-prompts", "1",
                "--draft-vocab", "32"]

    assert main(argv(6)) == 0, capsys.readouterr().err
    d = jaxspec.load_drafter(tmp_path / "out", jaxspec.load(model_dir))
    assert d.config.block_size == 4 and len(d.config.draft_vocab) == 32
    assert len(np.load(tmp_path / "work" / "data.npz")["tokens"]) == 6  # 3 prompts x 2 answers
    capsys.readouterr()
    assert main(argv(9, prompt_file=tmp_path / "gone.jsonl")) == 0  # data cached, so the prompts are not read
    assert "resumed from" in capsys.readouterr().err
    assert main(argv(1, prompt_file=tmp_path / "gone.jsonl", work="fresh")) == 2
    assert "not found" in capsys.readouterr().err and not (tmp_path / "fresh").exists()  # nothing half-written
    assert main(argv(1, work="fresh") + ["--draft-vocab", "-1"]) == 2
    assert "--draft-vocab" in capsys.readouterr().err and not (tmp_path / "fresh").exists()


def test_distill_files_train_alongside(tmp_path, capsys):
    """`python -m jaxspec.train.distill` writes answers (sample k the same whichever call draws it) that
    `python -m jaxspec.train --data` trains on; a file for another model or length is refused up front."""
    import json

    from jaxspec.train.__main__ import main as train_main
    from jaxspec.train.data import Dataset
    from jaxspec.train.distill import main as distill_main
    from test_cli import char_tokenizer, save_tiny

    model_dir = save_tiny(tmp_path / "model")
    char_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hi there", "Count to five", "Say yes"]))
    common = ["--model", str(model_dir), "--prompts", str(prompts), "--seq-len", "40", "--batch", "2"]
    assert distill_main(common + ["--samples", "3", "--out", str(tmp_path / "a.npz")]) == 0
    assert distill_main(common + ["--first-sample", "2", "--out", str(tmp_path / "b.npz")]) == 0
    a, b = Dataset.load(tmp_path / "a.npz"), Dataset.load(tmp_path / "b.npz")
    assert a.tokens.shape == (9, 40) and np.array_equal(a.tokens[6:], b.tokens)  # sample 2 either way
    assert not np.array_equal(a.tokens[:3], a.tokens[3:6])  # greedy vs sampled
    assert json.loads(str(np.load(tmp_path / "b.npz")["recipe"]))["first_sample"] == 2
    capsys.readouterr()

    def argv(data, work):
        return ["--model", str(model_dir), "--no-prompts", "--data", *map(str, data), "--heldout", str(prompts),
                "--out", str(tmp_path / "out"), "--work", str(tmp_path / work), "--steps", "2", "--batch", "2",
                "--anchors", "4", "--seq-len", "40", "--num-layers", "1", "--num-taps", "1", "--block-size", "4",
                "--eval-prompts", "0", "--draft-vocab", "0"]

    assert train_main(argv([tmp_path / "a.npz", tmp_path / "b.npz"], "w")) == 0, capsys.readouterr().err
    assert len(np.load(tmp_path / "w" / "data.npz")["tokens"]) == 12
    # --init goes on from an exported drafter: at lr 0 the export is that drafter, whatever the new data
    model, out2 = jaxspec.load(model_dir), tmp_path / "out2"
    assert train_main(argv([tmp_path / "b.npz"], "i") + ["--init", str(tmp_path / "out"), "--out", str(out2),
                                                        "--lr", "0"]) == 0, capsys.readouterr().err
    assert "starting from the weights" in capsys.readouterr().err
    jax.tree.map(np.testing.assert_array_equal, jaxspec.load_drafter(tmp_path / "out", model).params,
                 jaxspec.load_drafter(out2, model).params)
    for flags, msg in [(["--block-size", "8"], "pass --block-size 4"), (["--num-taps", "2"], "pass --num-taps 1"),
                       (["--tap-layers", "0"], "pass --tap-layers 1"), ([], "no config.json")]:
        init = str(tmp_path / ("out" if flags else "gone"))
        assert train_main(argv([tmp_path / "b.npz"], "fresh") + flags + ["--init", init]) == 2
        assert msg in capsys.readouterr().err and not (tmp_path / "fresh").exists()
    # --tap-layers picks the target layers by hand: they are what the cache holds and what the export reads
    assert train_main(argv([tmp_path / "b.npz"], "t") + ["--tap-layers", "0", "--out", str(tmp_path / "t0")]) == 0
    assert jaxspec.load_drafter(tmp_path / "t0", model).config.target_layer_ids == (0,)
    assert json.loads((tmp_path / "t" / "taps.json").read_text()) == [0]
    for taps, msg in [("0,2", "out of range"), ("0;1", "comma-separated")]:
        assert train_main(argv([tmp_path / "b.npz"], "fresh") + ["--tap-layers", taps]) == 2
        assert msg in capsys.readouterr().err and not (tmp_path / "fresh").exists()
    assert train_main(argv([tmp_path / "a.npz"], "w") + ["--soft-weight", "0.5"]) == 2  # cached without soft labels
    assert "without soft labels" in capsys.readouterr().err
    assert train_main(argv([tmp_path / "a.npz"], "s") + ["--soft-weight", "0.5"]) == 0, capsys.readouterr().err
    assert np.load(tmp_path / "s" / "soft.npz")["probs"].shape[:2] == (9, 40)
    assert train_main(argv([tmp_path / "a.npz"], "fresh") + ["--soft-weight", "1.5"]) == 2
    assert "--soft-weight" in capsys.readouterr().err and not (tmp_path / "fresh").exists()
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    for bad, msg in [(tmp_path / "gone.npz", "not found"), (tmp_path / "bad.npz", "not a jaxspec training data"),
                     (tmp_path / "a.npz", "not --seq-len")]:
        args = argv([bad], "fresh")
        if msg == "not --seq-len":
            args[args.index("--seq-len") + 1] = "48"
        assert train_main(args) == 2
        assert msg in capsys.readouterr().err and not (tmp_path / "fresh").exists()
    assert distill_main(common + ["--out", str(tmp_path / "c.txt")]) == 2
    assert ".npz" in capsys.readouterr().err


def test_interrupted_taps_pass_resumes(tmp_path, capsys, monkeypatch):
    """A taps pass stopped part-way (a session ending mid-pass) goes on from the rows it recorded when the
    same command runs again, and leaves the cache an uninterrupted pass leaves."""
    import json

    import jaxspec.train.__main__ as cli
    import jaxspec.train.data as D
    from jaxspec.train.distill import main as distill_main
    from test_cli import char_tokenizer, save_tiny

    model_dir = save_tiny(tmp_path / "model")
    char_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hi there", "Count to five", "Say yes"]))
    assert distill_main(["--model", str(model_dir), "--prompts", str(prompts), "--seq-len", "40", "--batch", "2",
                         "--samples", "3", "--out", str(tmp_path / "a.npz")]) == 0  # 9 rows: 3 batches of taps

    def argv(work):
        return ["--model", str(model_dir), "--no-prompts", "--data", str(tmp_path / "a.npz"), "--out",
                str(tmp_path / "out"), "--work", str(tmp_path / work), "--steps", "1", "--batch", "2", "--anchors", "4",
                "--seq-len", "40", "--num-layers", "1", "--num-taps", "1", "--block-size", "4", "--eval-prompts", "0",
                "--draft-vocab", "0", "--soft-weight", "0.5"]

    assert cli.main(argv("full")) == 0, capsys.readouterr().err
    real, calls = D.compute_taps, []

    def stopped(*a, progress, **k):  # the process ends once the first batch is recorded
        def p(rows):
            progress(rows)
            raise KeyboardInterrupt
        calls.append(k["done"])
        return real(*a, progress=p, **k)

    monkeypatch.setattr(cli, "SAVE_EVERY_S", 0.0)
    monkeypatch.setattr(D, "compute_taps", stopped)
    with pytest.raises(KeyboardInterrupt):
        cli.main(argv("w"))
    assert json.loads((tmp_path / "w" / "taps.partial.json").read_text()) == {"rows": 4, "soft": True}
    assert not (tmp_path / "w" / "data.npz").exists()
    recorded = []

    def resumed(*a, progress, **k):
        calls.append(k["done"])
        return real(*a, progress=lambda rows: recorded.append(rows) or progress(rows), **k)

    monkeypatch.setattr(D, "compute_taps", resumed)
    capsys.readouterr()
    assert cli.main(argv("w")) == 0, capsys.readouterr().err
    assert calls == [0, 4] and "resuming the taps pass at row 4 of 9" in capsys.readouterr().err
    assert recorded == [8, 9]  # only the rows left ran
    assert not (tmp_path / "w" / "taps.partial.json").exists()
    np.testing.assert_array_equal(np.load(tmp_path / "w" / "taps.npy"), np.load(tmp_path / "full" / "taps.npy"))
    for k in ("ids", "probs"):
        np.testing.assert_array_equal(np.load(tmp_path / "w" / "soft.npz")[k],
                                      np.load(tmp_path / "full" / "soft.npz")[k])
    assert cli.main(argv("w")) == 0  # then cached as usual
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "taps.partial.json").write_text("{")  # a corrupt progress record: one clear line
    capsys.readouterr()
    assert cli.main(argv("c")) == 2
    assert "not the progress record of a taps pass" in capsys.readouterr().err


def test_kept_data_files_are_whole_and_listed():
    """Every kept self-distillation part loads, says how it was made, and holds answers after prompts; the data
    README's table (file, answers, answer tokens, total) says what each file holds."""
    import json
    import re
    from pathlib import Path

    from jaxspec.train.data import Dataset

    dirs = sorted(p for p in (Path(__file__).parents[1] / "data").iterdir() if p.is_dir())
    assert dirs
    for d in dirs:
        readme = (d / "README.md").read_text()
        rows = re.findall(r"^\| `(\S+\.npz)` \|[^|]*\| \S+ \((\d+)\) \| ([\d ]+) \|", readme, re.M)
        assert rows and sorted(f for f, _, _ in rows) == sorted(p.name for p in d.glob("*.npz")), d
        total = [0, 0]
        for f, answers, tokens in rows:
            data = Dataset.load(d / f)
            recipe = json.loads(str(np.load(d / f)["recipe"]))
            assert data.tokens.shape[1] == recipe["seq_len"] and data.tokens.min() >= 0, f
            first = data.loss_mask.argmax(1)  # the answer starts after a non-empty prompt and runs to the row's end
            assert (first > 0).all() and (data.loss_mask.sum(1) == data.lengths - first).all(), f
            have = (len(data.tokens), int(data.loss_mask.sum()))
            assert have == (int(answers), int(tokens.replace(" ", ""))), (f, have)
            total = [total[0] + have[0], total[1] + have[1]]
        assert f"| all | | {total[0]} | {total[1]:,} |".replace(",", " ") in readme, total
