"""Statistics: hooks keep exactly the means and moments a brute-force pass computes; save/load; cache.

Uses a small in-process stand-in runtime (a random 4-layer Llama and a character tokenizer) with the
`Runtime` surface that statistics need, so these tests stay fast and independent of the release code.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from clef_model.errors import BlazeError
from surgery.directions import ContrastPair
from surgery.edit import collect_statistics
from surgery.statistics import PreserveSet, Statistics, collect, contrast_sequences


class CharTokenizer:
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [3 + (ord(c) % 120) for c in text]


class MiniRuntime:
    """The part of `clef_model.runtime.Runtime` that surgery uses, on a tiny random Llama."""

    def __init__(self, seed: int = 0, layers: int = 4):
        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(config).eval()
        self.release = SimpleNamespace(architecture="llama", path="mini", ref="mini", revision=None)
        self.device, self.dtype, self.is_clef = torch.device("cpu"), torch.float32, False
        self.tokenizer = CharTokenizer()

    def chat_ids(self, prompt, system=None, generation_prompt=True):
        text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
        return self.tokenizer.encode((f"S:{system}|" if system else "") + f"U:{text}|" + ("A:" if generation_prompt
                                                                                           else ""))

    def text_model(self):
        return self.model.model

    def decoder_layers(self):
        return list(self.model.model.layers)

    def named_linears(self):
        return {n: m for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}


PAIRS = [
    ContrastPair("capital of France?", "Paris.", "The capital of France is Paris, a lovely city.", "brief", "verbose"),
    ContrastPair("two plus two?", "4.", "Two plus two equals four, of course!", "brief", "verbose"),
    ContrastPair("colour of sky?", "Blue.", "On a clear day the sky looks blue.", None, None),
]


@pytest.fixture(scope="module")
def mini():
    return MiniRuntime()


def test_hooks_match_brute_force(mini):
    target = "model.layers.1.mlp.down_proj"
    preserve = PreserveSet(texts=["hello there", "a neutral sentence"])
    stats = collect(mini, PAIRS, preserve, [target], batch_size=2)
    seqs = contrast_sequences(mini, PAIRS)
    captured = {}
    module = mini.named_linears()[target]
    handle = module.register_forward_pre_hook(lambda _m, i: captured.__setitem__("k", i[0][0].double()))
    keys_all, res = [], []
    with torch.no_grad():
        for s in seqs:
            out = mini.model.model(input_ids=torch.tensor([s.ids]), output_hidden_states=True)
            res.append(out.hidden_states[2][0, s.positions].double().mean(0))   # output of layer 1
            keys_all.append(captured["k"][s.positions])
        kp = []
        for text in preserve.texts:
            mini.model.model(input_ids=torch.tensor([mini.chat_ids(text)]))
            kp.append(captured["k"])
    handle.remove()
    keys = torch.cat(keys_all)
    ks = stats.keys[target]
    assert ks.behaviour_count == len(keys)
    assert torch.allclose(ks.behaviour_mean, keys.mean(0), atol=1e-5)
    assert torch.allclose(ks.behaviour_moment, keys.T @ keys / len(keys), atol=1e-5)
    kp = torch.cat(kp)
    assert ks.preserve_count == len(kp)
    assert torch.allclose(ks.preserve_moment, kp.T @ kp / len(kp), atol=1e-5)
    # per pair: wanted = side 0, unwanted = side 1
    assert torch.allclose(stats.wanted_means[1][0].double(), res[0], atol=1e-4)
    assert torch.allclose(stats.unwanted_means[1][2].double(), res[5], atol=1e-4)
    assert torch.allclose(ks.wanted_means[1], keys_all[2].mean(0), atol=1e-5)
    both = torch.cat([keys_all[4], keys_all[5]])
    assert torch.allclose(ks.pair_means[2], both.mean(0), atol=1e-5)
    assert sorted(stats.wanted_means) == [0, 1, 2, 3]


def test_question_keys_stop_before_the_generation_prompt(mini):
    """--questions preserve: a question's tokens are preserved, its generation prompt (whose last position
    writes the answer's first token) is not; the moment is over exactly those keys."""
    from surgery.statistics import preserve_sequences

    question = "capital of Peru?"
    seqs = preserve_sequences(mini, PreserveSet(questions=[question]))
    full, bare = mini.chat_ids(question), mini.chat_ids(question, generation_prompt=False)
    assert len(bare) < len(full) and seqs[0].ids == full and seqs[0].positions == list(range(len(bare)))
    target = "model.layers.1.mlp.down_proj"
    captured = {}
    handle = mini.named_linears()[target].register_forward_pre_hook(
        lambda _m, i: captured.__setitem__("k", i[0][0].double()))
    with torch.no_grad():
        mini.model.model(input_ids=torch.tensor([full]))
    handle.remove()
    kp = captured["k"][: len(bare)]
    ks = collect(mini, PAIRS, PreserveSet(questions=[question]), [target]).keys[target]
    assert ks.preserve_count == len(bare)
    assert torch.allclose(ks.preserve_moment, kp.T @ kp / len(kp), atol=1e-5)


def test_questions_change_the_statistics_fingerprint(mini):
    from surgery.plan import statistics_fingerprint

    plain = statistics_fingerprint(mini, PAIRS, PreserveSet(texts=["hi"]), [], {})
    assert plain == statistics_fingerprint(mini, PAIRS, PreserveSet(texts=["hi"], questions=[]), [], {})
    assert plain != statistics_fingerprint(mini, PAIRS, PreserveSet(texts=["hi"], questions=["q?"]), [], {})


def test_response_positions_start_at_last_prompt_token(mini):
    seqs = contrast_sequences(mini, PAIRS[:1])
    prompt_len = len(mini.chat_ids(PAIRS[0].prompt, system="brief"))
    assert seqs[0].positions[0] == prompt_len - 1
    assert seqs[0].positions[-1] == len(seqs[0].ids) - 1
    assert len(seqs[0].positions) == len("Paris.") + 1


def test_shared_response_reads_both_answers_under_both_system_prompts(mini):
    """shared_response: the same response tokens follow the prompt on both sides; only the system differs."""
    seqs = contrast_sequences(mini, PAIRS[:1], positions="shared_response")
    assert [(s.pair, s.side) for s in seqs] == [(0, 0), (0, 0), (0, 1), (0, 1)]
    for side, system in enumerate(("brief", "verbose")):
        prompt = mini.chat_ids(PAIRS[0].prompt, system=system)
        for seq, response in zip(seqs[2 * side : 2 * side + 2], (PAIRS[0].wanted, PAIRS[0].unwanted), strict=True):
            assert seq.ids == prompt + mini.tokenizer.encode(response)
            assert seq.positions == list(range(len(prompt) - 1, len(seq.ids)))
    stats = collect(mini, PAIRS[:2], None, ["model.layers.1.mlp.down_proj"], positions="shared_response")
    ks = stats.keys["model.layers.1.mlp.down_proj"]
    assert ks.behaviour_count == sum(len(s.positions) for s in contrast_sequences(mini, PAIRS[:2],
                                                                                  positions="shared_response"))


def test_save_load_roundtrip(mini, tmp_path):
    stats = collect(mini, PAIRS, PreserveSet(texts=["hi"]), ["model.layers.0.self_attn.o_proj"])
    stats.save(tmp_path / "s.pt")
    again = Statistics.load(tmp_path / "s.pt")
    assert torch.equal(again.keys["model.layers.0.self_attn.o_proj"].preserve_moment,
                       stats.keys["model.layers.0.self_attn.o_proj"].preserve_moment)
    assert torch.equal(again.wanted_means[3], stats.wanted_means[3])
    (tmp_path / "bad.pt").write_text("not a file")
    with pytest.raises(BlazeError, match="delete it"):
        Statistics.load(tmp_path / "bad.pt")


def test_collect_statistics_auto_layers_and_cache(mini, tmp_path, monkeypatch):
    cache = tmp_path / "stats.pt"
    lines = []
    stats = collect_statistics(mini, PAIRS, {"texts": ["hello"]}, "auto", "writers", cache=cache, echo=lines.append)
    assert stats.meta["layers"] == [1, 2]          # 45% of 4 layers, never the first or last
    assert all(int(n.split(".")[2]) in (1, 2) for n in stats.keys)
    assert any("layers auto" in l for l in lines)
    import surgery.edit as edit

    monkeypatch.setattr(edit, "collect", lambda *a, **k: pytest.fail("cache was not used"))
    again = collect_statistics(mini, PAIRS, {"texts": ["hello"]}, "auto", "writers", cache=cache, echo=lines.append)
    assert again.meta["fingerprint"] == stats.meta["fingerprint"]


def test_requests_need_a_clef_release(mini):
    with pytest.raises(BlazeError, match="Clef"):
        collect(mini, PAIRS, PreserveSet(requests=[{"state": "x"}]), ["model.layers.0.mlp.down_proj"])
    with pytest.raises(BlazeError, match="no contrast pairs"):
        collect(mini, [], None, [])


def test_statistics_above_the_cache_limit_are_not_saved(mini, tmp_path, monkeypatch):
    cache = tmp_path / "stats.pt"
    lines = []
    monkeypatch.setenv("BLAZE_STATS_CACHE_MAX_GB", "0")
    stats = collect_statistics(mini, PAIRS, {"texts": ["hello"]}, "1-2", "writers", cache=cache, echo=lines.append)
    assert stats.nbytes() > 0 and not cache.exists()
    assert any("not saved" in l and "BLAZE_STATS_CACHE_MAX_GB" in l for l in lines)
    monkeypatch.setenv("BLAZE_STATS_CACHE_MAX_GB", "lots")
    with pytest.raises(BlazeError, match="gigabytes"):
        collect_statistics(mini, PAIRS, {"texts": ["hello"]}, "1-2", "writers", cache=cache)
    monkeypatch.delenv("BLAZE_STATS_CACHE_MAX_GB")
    collect_statistics(mini, PAIRS, {"texts": ["hello"]}, "1-2", "writers", cache=cache)
    assert cache.exists()                                   # small statistics: cached as before


def test_a_pass_stops_after_the_last_layer_read_with_the_same_statistics(mini):
    """Layers above the deepest target and residual layer are not run, and nothing collected changes."""
    target = "model.layers.1.mlp.down_proj"
    preserve = PreserveSet(texts=["keep this"])
    ran: list[int] = []
    handles = [layer.register_forward_hook(lambda _m, _i, _o, k=k: ran.append(k))
               for k, layer in enumerate(mini.decoder_layers())]
    try:
        short = collect(mini, PAIRS, preserve, [target], residual_layers=[0, 1], batch_size=2)
        deepest_short = max(ran)
        ran.clear()
        whole = collect(mini, PAIRS, preserve, [target], batch_size=2)   # every residual layer: the whole pass
    finally:
        for handle in handles:
            handle.remove()
    assert deepest_short == 1 and max(ran) == len(mini.decoder_layers()) - 1
    assert set(short.wanted_means) == {0, 1}
    for layer in (0, 1):
        assert torch.equal(short.wanted_means[layer], whole.wanted_means[layer])
    for name in ("behaviour_moment", "preserve_moment", "wanted_means", "unwanted_means"):
        assert torch.equal(getattr(short.keys[target], name), getattr(whole.keys[target], name))


def test_the_padded_width_bucket_changes_no_statistic(mini, monkeypatch):
    """CPU batches pad to their longest sequence, CUDA batches to a multiple of 64; either way the positions read,
    and so every mean and moment, are the same (right padding after causal mixers)."""
    import surgery.statistics as st
    from surgery.statistics import padded_batch, width_bucket

    assert width_bucket("cpu") == 1 and width_bucket("cuda") == 64 and width_bucket("cuda:1") == 64
    seqs = contrast_sequences(mini, PAIRS, 512, "response")
    ids, mask, _flat = padded_batch(seqs, 0, width_bucket("cpu"))
    assert ids.shape[1] == max(len(s.ids) for s in seqs) and ids.shape[1] % 64 != 0
    assert padded_batch(seqs, 0, width_bucket("cuda"))[0].shape[1] % 64 == 0
    target = "model.layers.1.mlp.down_proj"
    preserve = PreserveSet(texts=["keep this", "and this longer neutral text"])
    widths: list[int] = []
    real_padded_batch = st.padded_batch

    def watched(batch, pad, bucket):
        widths.append(max(len(s.ids) for s in batch))
        out = real_padded_batch(batch, pad, bucket)
        widths[-1] = out[0].shape[1] - widths[-1]  # the padding beyond the longest sequence
        return out

    monkeypatch.setattr(st, "padded_batch", watched)
    exact = collect(mini, PAIRS, preserve, [target], batch_size=2)
    assert widths and set(widths) == {0}  # the CPU run pads to each batch's longest sequence
    monkeypatch.setattr(st, "width_bucket", lambda _device: 64)
    bucketed = collect(mini, PAIRS, preserve, [target], batch_size=2)
    for layer, mean in exact.wanted_means.items():
        torch.testing.assert_close(mean, bucketed.wanted_means[layer], rtol=1e-5, atol=1e-7)
    for name in ("behaviour_moment", "preserve_moment", "pair_means"):
        torch.testing.assert_close(getattr(exact.keys[target], name), getattr(bucketed.keys[target], name),
                                   rtol=1e-5, atol=1e-7)
