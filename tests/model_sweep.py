"""Every causal-LM class of transformers' auto mapping, built tiny and random from its config, through HF greedy
``generate`` and through ``DFlashSpecWrapper``: each is lossless, refused before any work with a message, or FAILED.

    OMP_NUM_THREADS=1 .venv/bin/python tests/model_sweep.py [--only a,b] [--out benchmarks/results/model_sweep.md]

A model type is skipped (and counted, by reason) when its classes do not import here, when it is an encoder-decoder
model, when its config holds a non-text modality (vision, audio), or when it maps to the same class and config class as
another entry. The others are made tiny by one generic pass over their config (``tiny_config``: ``SIZES`` for the
usual fields, ``SHRINK`` for any other size by its name, per-layer fields cut to four layers keeping every kind of
layer, a few ``OVERRIDES`` the generic pass cannot know), then classified:

- ``unbuildable``: the tiny model cannot be built (the error);
- ``no generate support``: HF's own ``generate`` fails on it (the error);
- ``lossless``: the wrapper's greedy tokens equal HF's for two prompts at batch 1 and in a left-padded batch;
- ``refused``: the wrapper raised ``NotImplementedError`` / ``ValueError`` before any generation work (building the
  drafter or wrapper, ``kv_cache()``, or a ``generate`` before the target's first forward);
- ``FAILED``: anything else (a mismatch, a crash, a refusal after work began).

``tests/test_model_sweep.py`` runs the same check per model type under pytest.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
import re
import subprocess
import sys
import time
import traceback
import warnings

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.models.config import DFlashConfig

VOCAB = 96
PAD = VOCAB - 2
NEW = 8
LENGTHS = (5, 13)
LAYERS = 4
REPORT = "benchmarks/results/model_sweep.md"

# The sizes every tiny model gets, for whichever of these fields its config has (looked up through the config's
# ``attribute_map``: GPT-2's ``n_embd`` is its ``hidden_size``).
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)

# Every other integer field that sizes a model, by what its name says: (pattern, tiny value), the first match wins,
# applied only where the default is larger (a field already small keeps its value).
SHRINK = (
    (r"experts_per_tok|experts_per_token|^moe_k$|moe_topk|^top_k$|num_selected_experts|topk_experts", 2),
    (r"experts$|expert_num$|^n_routed_experts$|^num_experts$", 4),
    (r"(moe|expert).*(intermediate|ffn|hidden)|shared.*intermediate|expert_ffn", 32),
    (r"intermediate|ffn|ff_dim|^dff$|^d_inner$|dim_ff", 128),
    (r"qk_(rope|nope)_head_dim", 8),  # MLA: a query/key head of 16 in all
    (r"head_?dim|head_size|^dim_head$|d_head$|rotary_dim", 16),
    (r"rank$", 16),
    (r"window", 8),  # shorter than the prompts: windows are exercised
    (r"chunk", 16),
    (r"state_size|d_state|^state_dim$", 8),
    (r"key_heads$|kv_heads$|query_groups$", 2),
    (r"heads$", 4),
    (r"hidden_size|^d_model$|embed(ding)?_dim$|_width$|^n_embd$|embedding_size$|d_ssm$", 64),
    (r"vocab", VOCAB),
    (r"layers$", LAYERS // 2),  # a count of some of the layers (shared, recurrent, dense, ...)
    (r"_period$", 2),  # a layer pattern's period (every 8th layer attends: every 2nd)
    (r"^expand$|_expand$", 1),  # Mamba's inner width over the hidden size
    (r"^n_groups$|ngroups$|_n_groups$", 1),  # Mamba-2 B/C groups
    (r"^n_group$|^topk_group$", 1),  # MoE router groups
)
# The few fields the generic pass cannot know, per model type, each with why.
OVERRIDES: dict[str, dict] = {
    # Hybrids whose defaults lack one of the family's layer kinds; their checkpoints interleave both. LFM2: every
    # layer attends (no short convolution); LFM2-MoE: no layer_types at all (its model cannot build); Bamba and
    # Granite-MoE-hybrid: no attention layer (HF's generate cannot run a cache of Mamba layers only).
    "lfm2": dict(layer_types=["conv", "full_attention"] * 2),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2),
    "bamba": dict(attn_layer_indices=[1, 3]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] * 2),
    # Its rotary embedding is sized by head_dim, a plain field whose default equals qk_rope_head_dim's.
    "longcat_flash": dict(head_dim=8),
    # Its input, recurrent and output layer counts must add up to the depth.
    "dory": dict(n_input_layers=1, n_recurrent_layers=2, n_output_layers=1),
    # Its attention reads attn_config.rope_theta, which its attention config does not define, and clamps q/k/v by
    # clip_qkv, whose default (None) torch.clamp rejects.
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),
    # Its rotary embedding looks rope_parameters up by layer type; the default has no such entry.
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0)}),
    # Its indexed_attention layers need an indexer, whose sizes default to None.
    "qwen4_exp_text": dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=4),
    # Assistants (drafters) read every layer's K/V from their target: all layers shared (0: "all" to the config),
    # no per-layer inputs (their own validation demands 0 and their defaults say otherwise).
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                                              num_kv_shared_layers=0)),
    "gemma4_unified_assistant": dict(text_config=dict(num_kv_shared_layers=LAYERS)),
    # Axial position embeddings whose two widths add up to the hidden size and whose shape spans the positions; LSH
    # buckets, which default to None (set from the sequence length in training only).
    "reformer": dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 32], num_buckets=4),
}

# Fields the name patterns would catch but that are not sizes (or must keep their default).
KEEP = re.compile(r"token_id|token_index|_id$|^seed$|initializer|^layer_norm|_eps$|^rope|^use_|factor|scal|multipl")


@dataclasses.dataclass
class Result:
    model_type: str
    cls: str = ""
    outcome: str = ""
    message: str = ""
    cache_layers: str = ""
    seconds: float = 0.0


def _classes(model_type: str):
    """(config class, model class) of a model type; raises when they do not import here."""
    config_cls = CONFIG_MAPPING[model_type]
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return config_cls, model_cls


def _model_config_class(config_cls, model_cls):
    """The config class the model class is built from: the mapping's, or its text sub-config (as
    ``AutoModelForCausalLM.from_config`` swaps it for a text class of a multimodal checkpoint)."""
    text = getattr(config_cls, "sub_configs", {}).get("text_config")
    if text is not None and getattr(model_cls, "config_class", None) is text:
        return text
    return config_cls


NON_TEXT = re.compile(r"vision|audio|image|speech|video|vq")


def skip_reason(model_type: str, seen: dict | None = None) -> str | None:
    """Why this model type is not swept (None: it is). ``seen`` maps (model class, config class) to the first model
    type that had them, to skip later duplicates."""
    try:
        config_cls, model_cls = _classes(model_type)
    except Exception as e:  # noqa: BLE001 -- an optional dependency missing, say
        return f"not importable: {type(e).__name__}: {e}"
    config_cls = _model_config_class(config_cls, model_cls)
    try:
        config = config_cls()
    except Exception:  # noqa: BLE001
        return None  # the defaults alone do not build: the tiny pass says why (unbuildable)
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    modal = [k for k in getattr(config, "sub_configs", {}) if NON_TEXT.search(k)]
    if modal:
        return f"non-text modality: {', '.join(sorted(modal))}"
    if seen is not None:
        key = (model_cls, config_cls)
        first = seen.setdefault(key, model_type)
        if first != model_type:
            return f"same class and config class as another entry: {first}"
    return None


def _real_name(config, name: str) -> str | None:
    """The field ``name`` is stored as in ``config`` (through its ``attribute_map``), or None if it has no such
    settable field (a read-only property, or one that raises on access: XLNet's ``max_position_embeddings``)."""
    amap = getattr(config, "attribute_map", {}) or {}
    real = amap.get(name, name)
    if isinstance(inspect.getattr_static(type(config), real, None), property):
        return None
    try:
        return real if hasattr(config, real) else None
    except Exception:  # noqa: BLE001
        return None


def _fields(config) -> dict:
    """A config's own fields and values (no private ones)."""
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def _shrunk(name: str, value, aliases=()):
    """``value`` made tiny by ``SHRINK`` (or unchanged), for a field called ``name`` (or any of its ``aliases``)."""
    names = (name, *aliases)
    if any(KEEP.search(n) for n in names) or not isinstance(value, int) or isinstance(value, bool):
        return value
    for pattern, tiny in SHRINK:
        if any(re.search(pattern, n) for n in names):
            return tiny if value > tiny else value
    return value


def _layer_plan(defaults, n_default: int, n: int) -> tuple[list[int], dict]:
    """Which of the default model's layers the tiny one keeps, and the per-layer fields cut accordingly.

    A layer's kind is everything the config says about it: its entry in every per-layer list (``layer_types``,
    ``mlp_layer_types``, ``layers_block_type``, ...: lists as long as the model is deep), whether a list of layer
    indices (``attn_layer_indices``, ``hybrid_layer_ids``, ...) names it, and its per-layer overrides
    (``per_layer_config``). The tiny model keeps the first layer of every kind, then the earliest others, in order:
    Gemma3's five sliding layers and one full layer become three sliding and one full."""
    per_layer = {k: v for k, v in _fields(defaults).items() if isinstance(v, list) and len(v) == n_default}
    indices = {k: v for k, v in _fields(defaults).items()
               if k not in per_layer and re.search(r"layer|idx|indices", k) and isinstance(v, list) and v
               and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_default for i in v)}
    overrides = {}
    if getattr(defaults, "is_heterogeneous", False):
        overrides = {int(i): o for i, o in (defaults.to_dict().get("per_layer_config") or {}).items()}

    def kind(j):
        return (tuple(repr(v[j]) for v in per_layer.values()) + tuple(j in v for v in indices.values())
                + (repr(sorted(overrides.get(j, {}).items())),))

    firsts = sorted({kind(j): j for j in reversed(range(n_default))}.values())[:n]  # each kind's first layer
    src = sorted(firsts + [j for j in range(n_default) if j not in firsts][: n - len(firsts)])
    fields = {k: [_shrunk(k, v[j]) for j in src] for k, v in per_layer.items()}
    fields.update({k: [i for i, j in enumerate(src) if j in v] for k, v in indices.items()})
    if overrides:
        fields["per_layer_config"] = {i: {f: _shrunk(f, x) for f, x in overrides[j].items()}
                                      for i, j in enumerate(src) if j in overrides}
    return src, fields


def _tiny_kwargs(config_cls, defaults) -> dict:
    """Constructor arguments that make ``config_cls`` tiny, from its defaults (``defaults``, an instance)."""
    kw = {}
    for name, value in SIZES.items():
        real = _real_name(defaults, name)
        if real is not None:
            kw[real] = value
    heads, kv = (_real_name(defaults, n) for n in ("num_attention_heads", "num_key_value_heads"))
    if heads and kv and getattr(defaults, kv) in (None, getattr(defaults, heads)):  # multi-head attention stays so
        kw[kv] = kw[heads]
    amap = getattr(defaults, "attribute_map", {}) or {}
    for real, value in _fields(defaults).items():
        if real in kw or not isinstance(value, (int, type(None))):
            continue
        aliases = [a for a, r in amap.items() if r == real]
        if value is None and any(re.search(SHRINK[0][0] + "|" + SHRINK[1][0], n) for n in (real, *aliases)):
            value = 10 ** 6  # an MoE whose defaults leave it unsized
        tiny = _shrunk(real, value, aliases)
        if tiny != value:
            kw[real] = tiny
        elif re.search(r"_offset$", real) and isinstance(value, int) and f"{real[:-7]}_period" in kw:
            kw[real] = value % kw[f"{real[:-7]}_period"]  # a layer pattern's phase, in the shorter period
    for real, value in _fields(defaults).items():  # special token ids past the tiny vocabulary: the pad id
        if real.endswith("token_id"):
            if isinstance(value, int) and value >= VOCAB:
                kw[real] = PAD
            elif isinstance(value, list) and any(isinstance(v, int) and v >= VOCAB for v in value):
                kw[real] = [PAD]
    if hasattr(defaults, "is_decoder"):  # BERT-like classes are causal LMs only as decoders
        kw["is_decoder"] = True
    n_default = getattr(defaults, "num_hidden_layers", None)
    if isinstance(n_default, int):
        for name, values in _layer_plan(defaults, n_default, LAYERS)[1].items():  # a per-layer size: the tiny one
            kw[name] = [kw[name]] * len(values) if isinstance(kw.get(name), int) else values
    for name in getattr(config_cls, "sub_configs", {}) or {}:
        sub = getattr(defaults, name, None)
        if isinstance(sub, transformers.PretrainedConfig):
            kw[name] = {**sub.to_dict(), **_tiny_kwargs(type(sub), sub)}
    return kw


def tiny_config(model_type: str):
    """(model class, tiny config) of a model type: the config class's defaults with ``SIZES`` and ``SHRINK`` applied
    to whatever fields it has, per-layer fields cut to the tiny depth (``_layer_plan``), special token ids past the
    vocabulary replaced by the pad id, then the few ``OVERRIDES`` of its family."""
    config_cls, model_cls = _classes(model_type)
    config_cls = _model_config_class(config_cls, model_cls)
    try:
        defaults = config_cls()
    except Exception:  # noqa: BLE001 -- defaults its own validation rejects: with its family's overrides
        defaults = config_cls(**OVERRIDES.get(model_type, {}))
    kw = _tiny_kwargs(config_cls, defaults)
    for name, value in OVERRIDES.get(model_type, {}).items():  # into a sub-config: merged with its tiny fields
        kw[name] = {**kw[name], **value} if isinstance(value, dict) and isinstance(kw.get(name), dict) else value
    # A size the config derives from others (MLA's rotary head_dim, Zamba's attention width of twice the hidden
    # size) is left to it: whatever it derives from the tiny fields is what its model expects.
    fixed = set(OVERRIDES.get(model_type, {})) | (set(SIZES) - {"head_dim"})
    for name in [k for k, v in kw.items() if k not in fixed and isinstance(v, int) and not isinstance(v, bool)]:
        try:
            derived = getattr(config_cls(**{k: v for k, v in kw.items() if k != name}), name, None)
        except Exception:  # noqa: BLE001 -- it cannot do without: set it
            continue
        if derived != getattr(defaults, name, None) and isinstance(derived, int) and derived <= 8 * kw[name]:
            del kw[name]
    return model_cls, config_cls(**kw)


def build(model_type: str, seed: int = 0):
    """The tiny fp32 model of a model type, eval mode, sdpa attention where the class supports it (else eager),
    its generation config without eos / pad / bos."""
    model_cls, config = tiny_config(model_type)
    attn = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    for c in [config] + [getattr(config, k) for k in getattr(config, "sub_configs", {}) if hasattr(config, k)]:
        if isinstance(c, transformers.PretrainedConfig):
            c._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(torch.float32).eval()
    gc = model.generation_config
    gc.eos_token_id = gc.pad_token_id = gc.bos_token_id = None
    return model


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist() for n in LENGTHS]


def _cache_layers(cache) -> str:
    layers = getattr(cache, "layers", None)
    if layers is None:
        return type(cache).__name__
    names = [type(layer).__name__ for layer in layers]
    counts = {n: names.count(n) for n in dict.fromkeys(names)}
    return ", ".join(f"{n} x{c}" for n, c in counts.items()) or f"{type(cache).__name__} (no layers)"


def _error(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    msg = re.sub(r"\s+", " ", msg)
    return msg[:300]


_ROOTS = (os.path.dirname(os.path.dirname(transformers.__file__)), os.path.dirname(os.path.dirname(__file__)))


def _where(e: BaseException) -> str:
    """The innermost frame of a traceback, as `` (at transformers/models/x/modeling_x.py:12)``."""
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return ""
    path = tb[-1].filename
    for root in _ROOTS:
        if path.startswith(root + os.sep):
            path = os.path.relpath(path, root)
            break
    return f" (at {path}:{tb[-1].lineno})"


def check(model_type: str) -> Result:
    """Build, run HF greedy, run the wrapper: the outcome of one model type (never raises)."""
    t0 = time.perf_counter()
    r = Result(model_type)
    try:
        _check(model_type, r)
    finally:
        r.seconds = time.perf_counter() - t0
    return r


def _check(model_type: str, r: Result) -> None:
    try:
        _, model_cls = _classes(model_type)
        r.cls = model_cls.__name__
        model = build(model_type)
    except Exception as e:  # noqa: BLE001
        r.outcome, r.message = "unbuildable", _error(e)
        return
    ps = prompts()
    refs = []
    try:
        with torch.no_grad():
            for p in ps:
                out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW,
                                     return_dict_in_generate=True)
                refs.append(out.sequences[0, len(p):].tolist())
                r.cache_layers = _cache_layers(out.past_key_values)
        if any(len(ref) != NEW for ref in refs):
            raise RuntimeError(f"generate gave {[len(ref) for ref in refs]} new tokens, asked for {NEW}")
    except Exception as e:  # noqa: BLE001
        r.outcome, r.message = "no generate support", _error(e) + _where(e)
        return
    r.outcome, r.message = _through_wrapper(model, ps, refs, lambda: DFlashDraftModel.from_target(
        model, num_layers=1, block_size=4, seed=0))
    if r.outcome == "FAILED" and r.message.startswith("drafter:"):  # what the wrapper does past the drafter
        outcome, message = _through_wrapper(model, ps, refs, lambda: _hand_built_drafter(model))
        r.message += f" -- with a hand-built drafter: {outcome}" + (f": {message}" if message else "")
    if r.outcome == "lossless" and all(len(set(ref)) == 1 for ref in refs):
        r.message = "HF's reference repeats one token"


def _hand_built_drafter(model) -> DFlashDraftModel:
    """A 1-layer drafter of ``SIZES`` shapes over the target's hidden size and vocabulary, for targets whose config
    ``from_target`` cannot read."""
    tcfg = model.config.get_text_config()
    n = tcfg.num_hidden_layers
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=tcfg.hidden_size, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        layer_types=["full_attention"])
    dflash = DFlashConfig(block_size=4, mask_token_id=VOCAB - 1, target_layer_ids=(n // 2,),
                          layer_types=("full_attention",), num_target_layers=n)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = DFlashDraftModel(config, dflash)
        draft.reset_parameters()
    return draft.to(torch.float32).bind_target(model)


def _through_wrapper(model, ps, refs, drafter) -> tuple[str, str]:
    """(outcome, message) of the wrapper over ``model`` with the drafter ``drafter()`` builds: each prompt alone,
    then all left-padded, against HF's tokens ``refs``."""
    calls = [0]
    embed = model.get_input_embeddings()
    hook = embed.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1)) if embed else None
    stage = "drafter"
    spec = None
    try:
        draft = drafter()
        stage = "wrapper"
        spec = DFlashSpecWrapper(model, draft, speculation="fixed", max_batch_size=2, max_seq_len=64, page_size=8)
        stage = "kv_cache"
        spec.kv_cache()
        stage = "generate"
        calls[0] = 0  # the target's forwards from here on: generation work
        got = [spec.generate([p], max_new_tokens=NEW)[0, len(p):].tolist() for p in ps]
        stage = "padded generate"
        batch = spec.generate(ps, max_new_tokens=NEW, pad_token_id=PAD)
        got_batch = [batch[i, -NEW:].tolist() for i in range(len(ps))]
    except (NotImplementedError, ValueError) as e:
        before_work = stage in ("drafter", "wrapper", "kv_cache") or (stage == "generate" and calls[0] == 0)
        return ("refused" if before_work else "FAILED"), f"{stage}: {_error(e)}" + ("" if before_work else _where(e))
    except Exception as e:  # noqa: BLE001
        return "FAILED", f"{stage}: {_error(e)}{_where(e)}"
    finally:
        if hook is not None:
            hook.remove()
        if spec is not None:
            spec.close()
    bad = [(f"batch 1, prompt {i}", i, g) for i, g in enumerate(got) if g != refs[i]]
    bad += [(f"padded batch, row {i}", i, g) for i, g in enumerate(got_batch) if g != refs[i]]
    if bad:
        where, i, g = bad[0]
        ref = refs[i]
        first = next(j for j, (a, b) in enumerate(zip(g, ref)) if a != b)
        with torch.no_grad():  # a near tie would make the mismatch a rounding matter
            logits = model(torch.tensor([ps[i] + ref[:first]])).logits[0, -1].float()
        top = logits.topk(2).values
        return "FAILED", (f"mismatch in {len(bad)} of {2 * len(ps)} outputs; first: {where}, new token {first}: "
                          f"{g[first:first + 4]} vs HF {ref[first:first + 4]} (HF's top-2 logit gap there "
                          f"{(top[0] - top[1]).item():.2g})")
    return "lossless", ""


OUTCOMES = ("lossless", "refused", "FAILED", "no generate support", "unbuildable")


def model_types() -> list[str]:
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep_plan(only=None) -> tuple[list[str], dict[str, str]]:
    """(model types to check, {skipped model type: why}), of every model type or of those in ``only``."""
    run, skipped = _plan()
    if only:
        run, skipped = [mt for mt in run if mt in only], {mt: w for mt, w in skipped.items() if mt in only}
    return run, skipped


@functools.cache
def _plan() -> tuple[list[str], dict[str, str]]:
    seen, run, skipped = {}, [], {}
    for mt in model_types():  # the entry named as its config class names itself is the one kept of duplicates
        try:
            config_cls, model_cls = _classes(mt)
            config_cls = _model_config_class(config_cls, model_cls)
            if config_cls.model_type == mt:
                seen.setdefault((model_cls, config_cls), mt)
        except Exception:  # noqa: BLE001 -- skip_reason says why
            pass
    for mt in model_types():
        why = skip_reason(mt, seen)
        if why is None:
            run.append(mt)
        else:
            skipped[mt] = why
    return run, skipped


def _md(s: str) -> str:
    return s.replace("|", "\\|")


def _revision() -> str:
    """The repository's HEAD, and whether the package differs from it (the sweep runs the working tree)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        git = functools.partial(subprocess.run, capture_output=True, text=True, check=True)
        head = git(["git", "-C", root, "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = git(["git", "-C", root, "status", "--porcelain", "dflash_compile"]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return f"commit {head}" + (" with uncommitted changes to dflash_compile" if dirty else "")


def report(results: list[Result], skipped: dict[str, str], wall: float) -> str:
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    groups: dict[str, list[str]] = {}
    for mt, why in skipped.items():
        key, _, detail = why.partition(": ")
        groups.setdefault(key, []).append(f"{mt} ({detail})" if detail else mt)
    lines = [
        "# Model sweep: every causal-LM class of transformers' auto mapping",
        "",
        f"Generated by `OMP_NUM_THREADS=1 .venv/bin/python tests/model_sweep.py --out {REPORT}` ({_revision()}, "
        f"transformers {transformers.__version__}, torch {torch.__version__}, fp32, CPU, {torch.get_num_threads()} "
        f"thread(s)): {len(results)} of the {len(results) + len(skipped)} model types of "
        f"`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` checked, {len(skipped)} skipped, in {wall:.0f} s.",
        "",
        "Each model is built tiny and random from its config class's defaults (`tiny_config`: hidden 64, 4 layers, "
        f"4 heads / 2 KV heads, vocab {VOCAB}, small experts, windows and states), eos / pad / bos disabled. "
        f"HF greedy `generate` ({NEW} new tokens) on prompts of {' and '.join(map(str, LENGTHS))} tokens is the "
        "reference; the wrapper (random 1-layer drafter, block 4, `speculation=\"fixed\"`: every step verifies 3 "
        "drafts) must give the same tokens for each prompt alone and for both in a left-padded batch. `refused`: the "
        "wrapper raised `NotImplementedError` / `ValueError` before any generation work. Where `from_target` cannot "
        "build a drafter, the message says what the wrapper then does with a hand-built one (`_hand_built_drafter`). "
        "HF cache layers: the layer classes of the cache HF's own `generate` returned.",
        "",
        "| outcome | count |",
        "|---|---|",
        *[f"| {o} | {counts[o]} |" for o in OUTCOMES],
        f"| skipped | {len(skipped)} |",
        "",
        "| model type | class | HF cache layers | outcome | message | s |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (OUTCOMES.index(r.outcome), r.model_type)):
        lines.append(f"| {r.model_type} | {r.cls} | {_md(r.cache_layers)} | {r.outcome} | {_md(r.message)} | "
                     f"{r.seconds:.1f} |")
    lines += ["", "## Skipped", "", "| reason | model types |", "|---|---|"]
    for key, mts in groups.items():
        lines.append(f"| {_md(key)} ({len(mts)}) | {_md(', '.join(mts))} |")
    lines += ["", "## Per-family overrides", "",
              "Fields the generic pass cannot know, applied on top of it (why: `OVERRIDES` in `tests/model_sweep.py`):",
              ""]
    lines += [f"- {mt}: `{kw}`" for mt, kw in OVERRIDES.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--out", help="write the markdown report here")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    only = set(args.only.split(",")) if args.only else None
    t0 = time.perf_counter()
    run, skipped = sweep_plan(only)
    results = []
    for i, mt in enumerate(run):
        r = check(mt)
        results.append(r)
        print(f"[{i + 1}/{len(run)}] {mt:28s} {r.outcome:20s} {r.seconds:5.1f}s {r.message[:150]}", flush=True)
    wall = time.perf_counter() - t0
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    print(", ".join(f"{o}: {c}" for o, c in counts.items()) + f", skipped: {len(skipped)}; {wall:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            f.write(report(results, skipped, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
