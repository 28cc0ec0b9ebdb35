"""Every generate() argument against HF's own generate on the same inputs: the same tokens, or an error naming the
argument before any model work (the table in docs/generation.md, "Arguments against HF generate")."""

import contextlib

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.runtime.generation import resolve_generation_args
from tiny_models import VOCAB, tiny_target

PAD = VOCAB - 2
MAX_NEW = 16
ONE = (torch.tensor([[5, 17, 42, 8]]), None)
LEFT_PADDED = (
    torch.tensor([[3, 9, 27, 81, 11, 60, 7], [PAD] * 4 + [44, 2, 13]]),
    torch.tensor([[1] * 7, [0] * 4 + [1] * 3]),
)
INPUTS = pytest.mark.parametrize("inputs", [ONE, LEFT_PADDED], ids=["batch1", "left_padded"])


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tiny_target("qwen3")
    target.generation_config.pad_token_id = PAD  # a pad id for the tests that finish rows early
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, seed=0)
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=4, max_seq_len=96, page_size=8)
    yield target, spec
    spec.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def eos(pair):
    """A token the random target emits mid-generation in both inputs' first row (first at position >= 3), so a
    generation that stops one token early (or late) shows."""
    target, _ = pair
    rows = [target.generate(ids[:1], do_sample=False, max_new_tokens=MAX_NEW)[0, ids.shape[1]:].tolist()
            for ids, _ in (ONE, LEFT_PADDED)]
    token = next(t for t in rows[0] if 3 <= rows[0].index(t) and t in rows[1][3:])
    return token


@contextlib.contextmanager
def _config(target, **fields):
    """Set fields of ``target.generation_config`` for the block."""
    old = {k: getattr(target.generation_config, k) for k in fields}
    for k, v in fields.items():
        setattr(target.generation_config, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(target.generation_config, k, v)


def _same(pair, inputs, **kwargs):
    """HF's and DFlash's output for the same call; asserts they are token-identical and returns HF's."""
    target, spec = pair
    ids, mask = inputs
    ref = target.generate(ids, attention_mask=mask, **kwargs)
    out = spec.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(out, ref), (kwargs, out.tolist(), ref.tolist())
    return ref


def _assert_stopped_early(ref, inputs, eos):
    """Row 0 stopped at eos well before max_new_tokens (so a wrong stop would show)."""
    row = ref[0, inputs[0].shape[1]:].tolist()
    assert eos in row and row.index(eos) < MAX_NEW - 2, row


def _refused(pair, inputs, monkeypatch, error, match, **kwargs):
    _, spec = pair
    ids, mask = inputs

    def no_work(*a, **k):
        raise AssertionError("model work started before validation")

    monkeypatch.setattr(spec.dflash_step, "prefill", no_work)
    with pytest.raises(error, match=match):
        spec.generate(ids, attention_mask=mask, **kwargs)


# --- stopping, padding ---------------------------------------------------------------------------------------------

@INPUTS
def test_eos_from_target_config(pair, eos, inputs):
    with _config(pair[0], eos_token_id=eos):
        ref = _same(pair, inputs, max_new_tokens=MAX_NEW)
    _assert_stopped_early(ref, inputs, eos)


@INPUTS
def test_eos_list_argument(pair, eos, inputs):
    _same(pair, inputs, max_new_tokens=MAX_NEW, eos_token_id=[VOCAB - 1, eos])


@INPUTS
def test_pad_defaults_to_eos(pair, eos, inputs):
    """No pad_token_id anywhere: HF pads finished rows with eos_token_id[0], and so does DFlash."""
    with _config(pair[0], pad_token_id=None):
        _same(pair, inputs, max_new_tokens=MAX_NEW, eos_token_id=[eos, VOCAB - 1])


@INPUTS
def test_pad_argument(pair, eos, inputs):
    _same(pair, inputs, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=VOCAB - 1)


def test_explicit_none_eos_resolves_to_no_eos(pair, eos):
    """HF: an explicit ``eos_token_id=None`` never stops on eos, whatever the generation config says; so does the
    resolver."""
    target, _ = pair
    with _config(target, eos_token_id=eos):
        assert resolve_generation_args(target, 4, {"max_new_tokens": 3, "eos_token_id": None}).eos_token_ids == ()
        assert resolve_generation_args(target, 4, {"max_new_tokens": 3}).eos_token_ids == (eos,)
        ref = target.generate(ONE[0], max_new_tokens=MAX_NEW, eos_token_id=None)
    assert ref.shape[1] == 4 + MAX_NEW and (ref[0, 4:] == eos).any()


@INPUTS
def test_explicit_none_eos_through_generate(pair, eos, inputs):
    with _config(pair[0], eos_token_id=eos):
        _same(pair, inputs, max_new_tokens=MAX_NEW, eos_token_id=None)


# --- lengths ---------------------------------------------------------------------------------------------------------

@INPUTS
@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=5), dict(max_length=12), dict()], ids=str)
def test_lengths(pair, inputs, kwargs):
    """max_length counts the (padded) prompt; neither set anywhere: HF's 20 new tokens."""
    ref = _same(pair, inputs, **kwargs)
    assert ref.shape[1] == {"max_new_tokens": inputs[0].shape[1] + 5, "max_length": 12}.get(
        next(iter(kwargs), None), inputs[0].shape[1] + 20)


@INPUTS
def test_max_new_tokens_wins_over_max_length_with_a_warning(pair, inputs):
    with pytest.warns(UserWarning, match=r"max_new_tokens \(=6\) and max_length \(=30\)"):
        ref = _same(pair, inputs, max_new_tokens=6, max_length=30)
    assert ref.shape[1] == inputs[0].shape[1] + 6


@INPUTS
@pytest.mark.parametrize("field,value", [("max_new_tokens", 7), ("max_length", 13)])
def test_lengths_from_target_config(pair, inputs, field, value):
    with _config(pair[0], **{field: value}):
        _same(pair, inputs)


@INPUTS
def test_lengths_from_generation_config_argument(pair, inputs):
    _same(pair, inputs, generation_config=GenerationConfig(max_length=15))
    with _config(pair[0], max_new_tokens=3):  # the argument's config wins over the target's
        _same(pair, inputs, generation_config=GenerationConfig(max_new_tokens=9))


@INPUTS
@pytest.mark.parametrize("field", ["max_new_tokens", "max_length"])
def test_lengths_that_leave_nothing_are_errors_as_in_hf(pair, inputs, monkeypatch, field):
    target, _ = pair
    width = inputs[0].shape[1]
    kwargs = {field: 0 if field == "max_new_tokens" else width}
    match = "max_new_tokens must be >= 1" if field == "max_new_tokens" else f"max_length={width} leaves no new token"
    with pytest.raises(ValueError):
        target.generate(inputs[0], attention_mask=inputs[1], **kwargs)
    _refused(pair, inputs, monkeypatch, ValueError, match, **kwargs)


@pytest.mark.parametrize("config_length", [None, 12])
def test_max_length_none_is_an_error(pair, monkeypatch, config_length):
    with _config(pair[0], max_length=config_length):
        with pytest.raises(TypeError):  # HF fails inside generate
            pair[0].generate(ONE[0], max_length=None)
        _same(pair, ONE, max_length=None, max_new_tokens=3)
        _refused(pair, ONE, monkeypatch, ValueError, "max_length=None without max_new_tokens", max_length=None)


@INPUTS
def test_min_lengths_without_eos_are_no_ops(pair, inputs):
    _same(pair, inputs, max_new_tokens=MAX_NEW, min_new_tokens=10, min_length=30)


@INPUTS
def test_min_length_within_the_prompt_is_a_no_op(pair, eos, inputs):
    _same(pair, inputs, max_new_tokens=MAX_NEW, eos_token_id=eos, min_length=inputs[0].shape[1], min_new_tokens=0)


@INPUTS
@pytest.mark.parametrize("field", ["min_new_tokens", "min_length"])
def test_min_lengths_with_eos_are_refused(pair, eos, inputs, monkeypatch, field):
    target, _ = pair
    value = 10 if field == "min_new_tokens" else inputs[0].shape[1] + 10
    ids, mask = inputs
    free = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    held = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, **{field: value})
    assert not torch.equal(free, held)  # HF's output really changes: accepting it would be silently different
    _refused(pair, inputs, monkeypatch, ValueError, f"{field}={value}: suppressing the eos",
             max_new_tokens=MAX_NEW, eos_token_id=eos, **{field: value})
    with _config(target, eos_token_id=eos):
        _refused(pair, inputs, monkeypatch, ValueError, f"{field}={value}",
                 max_new_tokens=MAX_NEW, **{field: value})


# --- search mode and sampling parameters -----------------------------------------------------------------------------

@INPUTS
@pytest.mark.parametrize("kwargs", [
    dict(do_sample=False, temperature=0.0),
    dict(do_sample=False, temperature=0.5, top_k=3, top_p=0.5),
    dict(do_sample=False, min_p=0.2, typical_p=0.5, epsilon_cutoff=0.1, eta_cutoff=0.1, top_h=0.5),
    dict(do_sample=None),
    dict(num_beams=1, num_return_sequences=1),
    dict(use_cache=False, bos_token_id=3, renormalize_logits=True, length_penalty=2.0, early_stopping=True),
    dict(repetition_penalty=1.0, no_repeat_ngram_size=0, guidance_scale=1.0),
    dict(cache_implementation="static"),
    dict(logits_processor=LogitsProcessorList(), stopping_criteria=StoppingCriteriaList()),
], ids=lambda kw: ",".join(kw))
def test_greedy_ignores_as_hf_does(pair, inputs, kwargs):
    _same(pair, inputs, max_new_tokens=MAX_NEW, **kwargs)


@INPUTS
def test_generation_config_argument_merges_with_the_targets(pair, eos, inputs):
    """HF fills the argument's unset fields from target.generation_config: its eos still stops."""
    with _config(pair[0], eos_token_id=eos):
        ref = _same(pair, inputs, generation_config=GenerationConfig(max_new_tokens=MAX_NEW))
    _assert_stopped_early(ref, inputs, eos)


@INPUTS
def test_kwargs_override_the_generation_config(pair, inputs):
    cfg = GenerationConfig(do_sample=True, temperature=0.7, top_k=10, max_new_tokens=4, repetition_penalty=1.5)
    _same(pair, inputs, generation_config=cfg, do_sample=False, max_new_tokens=MAX_NEW, repetition_penalty=1.0)
    with _config(pair[0], repetition_penalty=1.3):  # a real checkpoint's config (Qwen2.5 ships 1.05)
        _same(pair, inputs, max_new_tokens=MAX_NEW, repetition_penalty=1.0)


def test_explicit_none_sampling_parameters_turn_them_off(pair):
    """HF: ``top_k=None`` is no top-k (not the default 50), ``temperature=None`` and ``top_p=None`` are 1."""
    target, _ = pair
    args = resolve_generation_args(target, 4, dict(max_new_tokens=2, do_sample=True, top_k=None, temperature=None,
                                                   top_p=None))
    assert (args.top_k, args.temperature, args.top_p) == (0, 1.0, 1.0)
    assert resolve_generation_args(target, 4, dict(max_new_tokens=2, do_sample=True)).top_k == 50


REFUSED = [
    ("num_beams", 4), ("num_beams", None), ("num_return_sequences", 2), ("num_return_sequences", None),
    ("repetition_penalty", 1.3), ("encoder_repetition_penalty", 1.3), ("no_repeat_ngram_size", 2),
    ("encoder_no_repeat_ngram_size", 2), ("bad_words_ids", [[7]]), ("force_words_ids", [[7]]),
    ("suppress_tokens", [7]), ("begin_suppress_tokens", [7]), ("sequence_bias", {(7,): -1.0}),
    ("guidance_scale", 1.5), ("forced_bos_token_id", 7), ("forced_eos_token_id", 7),
    ("exponential_decay_length_penalty", (2, 1.5)), ("remove_invalid_values", True), ("token_healing", True),
    ("max_time", 10.0), ("penalty_alpha", 0.6), ("prompt_lookup_num_tokens", 3), ("dola_layers", "low"),
    ("output_scores", True), ("output_logits", True), ("output_attentions", True), ("output_hidden_states", True),
    ("cache_implementation", "paged"),
]


@INPUTS
@pytest.mark.parametrize("name,value", REFUSED, ids=[f"{n}={v}" for n, v in REFUSED])
def test_refused_arguments(pair, inputs, monkeypatch, name, value):
    _refused(pair, inputs, monkeypatch, ValueError, f"^{name}=", max_new_tokens=MAX_NEW, **{name: value})


@pytest.mark.parametrize("name,value,off", [("repetition_penalty", 1.3, 1.0), ("suppress_tokens", [7], None),
                                            ("num_beams", 2, 1)])
def test_refused_from_a_generation_config(pair, monkeypatch, name, value, off):
    """Refused from either config, naming where it comes from; an argument at the no-op value overrides it."""
    with _config(pair[0], **{name: value}):
        _same(pair, ONE, max_new_tokens=MAX_NEW, **{name: off})
        _refused(pair, ONE, monkeypatch, ValueError, f"^{name}=.* \\(from target.generation_config; an argument",
                 max_new_tokens=MAX_NEW)
    _refused(pair, ONE, monkeypatch, ValueError, f"^{name}=.* \\(from generation_config;",
             generation_config=GenerationConfig(max_new_tokens=MAX_NEW, **{name: value}))


@pytest.mark.parametrize("name", ["min_p", "typical_p", "top_h", "epsilon_cutoff", "eta_cutoff"])
def test_sampling_warpers_refused_when_sampling(pair, monkeypatch, name):
    _refused(pair, ONE, monkeypatch, ValueError, f"^{name}=0.5", max_new_tokens=4, do_sample=True, seed=0,
             **{name: 0.5})


@pytest.mark.parametrize("name,value", [
    ("logits_processor", LogitsProcessorList([lambda ids, scores: scores])),
    ("stopping_criteria", StoppingCriteriaList([lambda ids, scores: False])),
    ("prefix_allowed_tokens_fn", lambda batch, ids: [1]),
    ("assistant_model", object()),
    ("negative_prompt_ids", torch.tensor([[1]])),
    ("custom_generate", "some/repo"),
])
def test_refused_generate_arguments(pair, monkeypatch, name, value):
    _refused(pair, ONE, monkeypatch, ValueError, f"^{name}= is not supported", max_new_tokens=4, **{name: value})


@pytest.mark.parametrize("name", ["inputs_embeds", "past_key_values", "typo"])
def test_other_names_are_type_errors(pair, monkeypatch, name):
    _refused(pair, ONE, monkeypatch, TypeError, f"unsupported arguments \\['{name}'\\]", max_new_tokens=4,
             **{name: None})


def test_every_hf_field_is_classified(pair, monkeypatch):
    """Each GenerationConfig field is resolved, has no effect, or is refused; one that DFlash does not know (a later
    transformers) is refused unless unset."""
    from dflash_compile.runtime import generation

    fields = set(GenerationConfig().to_dict())
    known = generation._RESOLVED | generation._NO_EFFECT | set(generation._REFUSED) | set(generation._SAMPLING_ONLY)
    assert fields <= known, sorted(fields - known)
    monkeypatch.setattr(generation, "_config_fields", lambda: fields | {"brand_new_processor"})
    with pytest.raises(ValueError, match="^brand_new_processor=0.5: "):
        resolve_generation_args(pair[0], 4, {"max_new_tokens": 2, "brand_new_processor": 0.5})
    assert resolve_generation_args(pair[0], 4, {"max_new_tokens": 2, "brand_new_processor": None}).max_new_tokens == 2


# --- attention-mask inference (no attention_mask given) ---------------------------------------------------------------

def test_mask_inferred_from_pad_in_a_batch(pair):
    _same(pair, (LEFT_PADDED[0], None), max_new_tokens=MAX_NEW)


def test_no_mask_inferred_when_pad_is_eos(pair, eos):
    ids = LEFT_PADDED[0].clone()
    ids[1, :4] = eos
    _same(pair, (ids, None), max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=eos)


def test_mask_inferred_for_one_row(pair):
    _same(pair, (torch.tensor([[PAD, PAD, 5, 17, 42, 8]]), None), max_new_tokens=MAX_NEW)


@pytest.mark.parametrize("inputs", [LEFT_PADDED, (LEFT_PADDED[0][:, 4:], None)], ids=["masked", "unpadded"])
def test_tensor_batch_without_pad_or_eos(pair, inputs):
    # The tensor is the output's prefix as given, so nothing needs a pad id: HF runs it, and so do we. (A list of
    # prompts of several lengths does need one, to left-pad them.)
    with _config(pair[0], pad_token_id=None, eos_token_id=None):
        _same(pair, inputs, max_new_tokens=MAX_NEW)
        with pytest.raises(ValueError, match="pad_token_id .* is required to pad a batch"):
            pair[1].generate([[5, 17, 42], [8]], max_new_tokens=MAX_NEW)
