"""The HF-like generate API: generation_config, sampling arguments, stop_strings, streamers, errors up front."""

import threading

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, TextIteratorStreamer, TextStreamer

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.runtime.target_check import check_tokenizer
from tiny_models import VOCAB, tiny_target

PROMPT = [5, 17, 42, 8]


def _tokenizer(size=VOCAB):
    vocab = {f"w{i}": i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add contention
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0)
    # a fixed K: seeded sampled calls below are compared with each other (under auto, only their law is the same)
    yield target, DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=4, max_seq_len=64)
    torch.set_num_threads(threads)


def _greedy(target, n):
    return target.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=n)[0, len(PROMPT):].tolist()


def test_generation_config_and_overrides(pair):
    target, spec = pair
    cfg = GenerationConfig(do_sample=True, temperature=0.7, top_k=10, max_new_tokens=5)
    a = spec.generate([PROMPT], generation_config=cfg, seed=3)
    assert a.shape == (1, len(PROMPT) + 5)
    assert torch.equal(a, spec.generate([PROMPT], do_sample=True, temperature=0.7, top_k=10, max_new_tokens=5, seed=3))
    top1 = spec.generate([PROMPT], generation_config=cfg, top_k=1, seed=3)  # a kwarg overrides the config
    assert top1[0, len(PROMPT):].tolist() == _greedy(target, 5)
    # kwargs override the config; do_sample=False ignores temperature/top-k/top-p, as HF does
    out = spec.generate([PROMPT], generation_config=cfg, do_sample=False, temperature=0.0, max_new_tokens=9)
    assert out[0, len(PROMPT):].tolist() == _greedy(target, 9)
    target.generation_config.do_sample = True
    try:
        assert torch.equal(spec.generate([PROMPT], max_new_tokens=5, temperature=0.7, top_k=10, seed=3), a)
    finally:
        target.generation_config.do_sample = False


def test_stop_strings(pair):
    target, spec = pair
    tok = _tokenizer()
    free = _greedy(target, 12)
    stop = tok.decode(free[:5])
    out = spec.generate([PROMPT], max_new_tokens=12, stop_strings=[stop], tokenizer=tok, return_dict_in_generate=True)
    assert out.sequences[0, len(PROMPT):].tolist() == free[:5]
    assert out.finish_reasons == ["stop"] and out.num_new_tokens == [5]
    out = spec.generate([PROMPT], max_new_tokens=12, stop_strings="never there", tokenizer=tok,
                        return_dict_in_generate=True)
    assert out.finish_reasons == ["length"] and out.num_new_tokens == [12]
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer"):
        spec.generate([PROMPT], max_new_tokens=4, stop_strings=["x"])


class _Collect(TextStreamer):
    def __init__(self, tok):
        super().__init__(tok, skip_prompt=True)
        self.text = ""

    def on_finalized_text(self, text, stream_end=False):
        self.text += text


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_streamers_match_decoded_output(pair, sample):
    _, spec = pair
    tok = _tokenizer()
    kw = dict(max_new_tokens=14, do_sample=sample, seed=5)
    out = spec.generate([PROMPT], **kw)
    expected = tok.decode(out[0, len(PROMPT):])

    streamer = _Collect(tok)
    assert torch.equal(spec.generate([PROMPT], streamer=streamer, **kw), out)
    assert streamer.text == expected

    it = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", spec.generate([PROMPT], streamer=it, **kw)))
    worker.start()
    pieces = list(it)
    worker.join()
    assert "".join(pieces) == expected and torch.equal(result["out"], out)


def test_streamer_sees_prompt_then_tokens_in_order(pair):
    _, spec = pair

    class Record:
        def __init__(self):
            self.calls, self.ended = [], False

        def put(self, value):
            self.calls.append(value.tolist())

        def end(self):
            self.ended = True

    rec = Record()
    out = spec.generate([PROMPT], max_new_tokens=7, streamer=rec)
    assert rec.calls[0] == [PROMPT] and rec.ended
    assert [c[0] for c in rec.calls[1:]] == out[0, len(PROMPT):].tolist()
    with pytest.raises(ValueError, match="batch size 1"):
        spec.generate([PROMPT, PROMPT], max_new_tokens=2, pad_token_id=0, streamer=Record())


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(input_ids=[[]]), ValueError, "empty"),
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "empty"),
    (dict(input_ids=[[1, VOCAB]]), ValueError, "outside the vocabulary"),
    (dict(input_ids=[[-1, 2]]), ValueError, "outside the vocabulary"),
    (dict(do_sample=True, temperature=0.0), ValueError, "temperature must be > 0"),
    (dict(do_sample=True, temperature=-1.0), ValueError, "temperature must be > 0"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(do_sample=True, top_k=-1), ValueError, "top_k must be"),
    (dict(tokenizer=_tokenizer(VOCAB + 4)), ValueError, "tokenizer has 100 tokens but the target's vocabulary has 96"),
    (dict(seed=[1, 2]), ValueError, "2 seeds for 1 prompts"),
    (dict(do_sample=True, seed=1, generator=torch.Generator()), ValueError, "not both"),
    (dict(typo=1), TypeError, "unsupported arguments"),
])
def test_errors_before_any_work(pair, monkeypatch, kwargs, error, match):
    _, spec = pair

    def no_work(*a, **k):
        raise AssertionError("model work started before validation")

    monkeypatch.setattr(spec.dflash_step, "prefill", no_work)
    kwargs = dict(kwargs)
    ids = kwargs.pop("input_ids", [PROMPT])
    if "seed" in kwargs and "generator" not in kwargs:
        kwargs["do_sample"] = True
    with pytest.raises(error, match=match):
        spec.generate(ids, max_new_tokens=4, **kwargs)


def test_check_tokenizer(pair):
    target, _ = pair
    check_tokenizer(_tokenizer(), target)
    check_tokenizer(_tokenizer(VOCAB - 10), target)  # smaller is fine (padded embedding rows)
    with pytest.raises(ValueError, match="do not belong together"):
        check_tokenizer(_tokenizer(VOCAB + 1), target)


def test_unsupported_logits_processors_in_generation_config_are_errors():
    import transformers

    from dflash_compile.runtime.generation import resolve_generation_args

    class _Target:
        generation_config = transformers.GenerationConfig(repetition_penalty=1.3)

    with pytest.raises(ValueError, match="repetition_penalty"):
        resolve_generation_args(_Target(), 4, {"max_new_tokens": 3})
