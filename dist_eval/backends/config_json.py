"""config.json as either transformers generation saves it, read one way: the form the blocks read.

transformers 5.x moved fields of config.json that change a model's numbers. A reader that looks
for them where 4.x wrote them finds nothing and takes the default (RoPE at theta 10000, no scaling):
a different model, without a word. Every reader of config.json in dist_eval (the client's and the
servers' transformers configs, through :func:`transformers_replacements`; the swarm's placement and
status, which read the file itself) goes through :func:`read_as_saved`, which gives the fields where
the pinned code reads them:

=====================================  ==================================  ==========================================
what                                   4.x (and the pinned 4.33) writes    5.x writes
=====================================  ==================================  ==========================================
RoPE base                              ``rope_theta``                      ``rope_parameters.rope_theta``
RoPE scaling                           ``rope_scaling`` ``{rope_type...}`` ``rope_parameters`` ``{rope_type, ...}``
share of each head that rotates        ``partial_rotary_factor``           ``rope_parameters.partial_rotary_factor``
RoPE of each attention type            -                                   ``rope_parameters`` ``{TYPE: {...}, ...}``
the dtype the weights were saved in    ``torch_dtype``                     ``dtype``
a family's renamed field               the family table's                  ``Family.config_renames`` (5.x name first)
which blocks attend in a window        ``use_sliding_window`` (+ window)   ``layer_types`` too
=====================================  ==================================  ==========================================

Nothing is guessed: a field in a form not read here, a RoPE setting of a kind the blocks do not
compute with a key they do not read, a layer type no block here computes, or the two forms giving
different values, is refused in one line naming the field and the file (:class:`UsageError`,
before any weight is read). The fields read from the 5.x form are kept under :data:`READ_AS` (the
4.x-form values), so that what depends on them can tell: the row store's key takes them (rows
stored under the wrong reading are not served), and a swarm of stock petals servers, which read
such a folder the 4.x way, is refused for it (:func:`dist_eval.backends.blocks.needs_block_options`).

A field the file leaves out takes the default of the family's own transformers 5.x config class, as transformers
reads the file (``Family.config_defaults``: a RoPE base, yarn, a norm's epsilon), not the default of the base family's
config class that the family's is built on; those that change a computed row are kept under :data:`DEFAULTS_FILLED`,
for the key.
"""
from __future__ import annotations

import copy
import functools
import json
import os
from types import SimpleNamespace
from typing import Optional

from dist_eval.backends.families import family_named, family_of
from dist_eval.errors import UsageError

# the key the fields read from the 5.x form are kept under (4.x-form values), in the dict and the config object
READ_AS = "dist_eval_read_as"
# the keys of rope_scaling (rope_parameters) each RoPE kind computed here reads; another key of one of
# these kinds is refused (it would change the numbers unread). Kinds not here are refused by the family table.
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
}
_KIND_KEYS = ("rope_type", "type")
# attention kinds of transformers' layer_types; which of them a family's blocks compute is its table entry's
LAYER_TYPES_READ = ("full_attention",)
# earlier names of those kinds, read as transformers 5.23 reads them (its _LEGACY_LAYER_TYPE_REMAP): a GLM-5 or
# DeepSeek-V3.2 folder saved by transformers 5.17 says deepseek_sparse_attention where 5.23 says indexed_attention
LEGACY_LAYER_TYPES = {"attention": "full_attention", "mamba": "linear_attention",
                      "deepseek_sparse_attention": "indexed_attention"}


def saved_model_type(model_dir) -> Optional[str]:
    """config.json's ``model_type`` as saved in the folder ``model_dir`` (None: no such folder, file or field, or a
    file that does not parse: the caller's own reading then says what is wrong).
    """
    try:
        with open(os.path.join(str(model_dir), "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def saved_family_type(model_dir) -> Optional[str]:
    """:func:`saved_model_type`, a family's alias (``Family.model_type_aliases``) read as the family's: the name
    dist_eval's classes are registered under (in petals' registry too).
    """
    model_type = saved_model_type(model_dir)
    family = family_named(model_type)
    return family.model_type if family is not None else model_type


def read_config_json(model_dir: str) -> dict:
    """``model_dir``'s config.json as the blocks read it (:func:`read_as_saved`); a UsageError naming the
    file when it is missing or not a JSON object.
    """
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read its config.json ({type(e).__name__}: {e}). Pass a folder saved with "
                         "save_pretrained().", param="model_dir", value=model_dir) from e
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: expected a JSON object, found {type(raw).__name__}. Pass a folder saved with "
                         "save_pretrained().", param="model_dir", value=model_dir)
    return read_as_saved(raw, path)


def read_as_saved(raw: dict, where: str) -> dict:
    """``raw`` (config.json's object, saved by transformers 4.x or 5.x) with every field where the pinned
    code reads it (the module's table); ``where``: the file, for the refusal. The fields read from the 5.x
    form are also under :data:`READ_AS`. Idempotent.
    """
    config = dict(raw)
    # an alias (Family.model_type_aliases) stays as saved: transformers, in the same process, chooses its own
    # reading of the folder's tensors by it
    family = family_named(config.get("model_type"))
    if family is not None and family.text_prefix and isinstance(config.get("text_config"), dict):
        config = _text_model_config(config, family)
    moved = dict(config.get(READ_AS) or {})
    if "rope_parameters" in config and config["rope_parameters"] is None:
        del config["rope_parameters"]  # transformers 5.x reads null as absent: the class's RoPE
    if family is not None and family.rope_labels and _labelled(config.get("rope_parameters"), family):
        moved.update(_rope_by_label(config, family.rope_labels, where))
    if "rope_parameters" in config:
        moved.update(_rope_from_parameters(config, where, family))
    if family is not None and family.partial_from_rotary_dim and isinstance(config.get("rotary_dim"), int) and (
            "partial_rotary_factor" not in config and "partial_rotary_factor" not in moved):
        head_dim = config.get("head_dim") or dict(family.block_options).get("head_dim")
        config["partial_rotary_factor"] = config["rotary_dim"] / head_dim
    if "dtype" in config and "torch_dtype" not in config:
        config["torch_dtype"] = config["dtype"]
    for new, old in family.config_renames if family else ():
        if new in config:
            _agree(config, old, config.pop(new), where, f"{new} (transformers 5.x's name for {old})")
            moved[old] = config[old]
    if family is not None:
        _read_layer_types(config, family, where)
        filled = {**(config.get(DEFAULTS_FILLED) or {}), **_fill_defaults(config, family, moved)}
        if filled:
            config[DEFAULTS_FILLED] = filled
    if config.get("rope_scaling") is not None:
        _check_rope_keys(config["rope_scaling"], "rope_parameters" if "rope_scaling" in moved else "rope_scaling",
                         where)
    if moved:
        config[READ_AS] = moved
    return config


# what a vision-language config.json says at its top level about the whole model, kept in the text model's
# config read from its text_config (the top level's tie_word_embeddings ties the head the release has; its
# quantization_config, Kimi K2.5's INT4 experts, says how the text model's weights are stored: read or refused)
WHOLE_MODEL_KEYS = ("tie_word_embeddings", "architectures", "dtype", "torch_dtype", "transformers_version",
                    "quantization_config")


# the key the family defaults filled into a file that leaves them out are kept under (those that change a computed row)
DEFAULTS_FILLED = "dist_eval_defaults_filled"
# the RoPE base of a file that gives none, where the family's table gives no other (transformers' default_theta)
DEFAULT_ROPE_THETA = 10000.0
# filled defaults that decide only which rows are refused (a row past a window, or a window a switch turns on, is
# refused, never computed another way): left out of DEFAULTS_FILLED, so the row store's key of a folder whose file
# leaves them out (one saved by the config classes built here, which have no window field) is what it was
DECIDE_REFUSALS_ONLY = ("sliding_window",)


def _fill_defaults(config: dict, family, moved: dict) -> dict:
    """Set each of the family's ``config_defaults`` that ``config`` leaves out (``rope_scaling``: where neither it nor
    ``rope_parameters`` is given), as transformers 5.x's config class of the family fills it; the values set that
    change a computed row (kept under :data:`DEFAULTS_FILLED`). The config class built here would take its base
    family's defaults there (a RoPE base of 10000 for 1e6): another model, without a word.
    """
    filled = {}
    for name, value in family.config_defaults:
        # transformers reads a null or empty RoPE setting as none given
        absent = not config.get(name) and name not in moved if name == "rope_scaling" else name not in config
        if absent:
            config[name] = copy.deepcopy(value)
            if name not in DECIDE_REFUSALS_ONLY:
                filled[name] = copy.deepcopy(value)  # not the object the config class may add to
    return filled


def default_rope_theta(family) -> float:
    """The RoPE base a file of ``family`` (None: of no family here) that gives none has."""
    return dict(family.config_defaults).get("rope_theta", DEFAULT_ROPE_THETA) if family else DEFAULT_ROPE_THETA


def _text_model_config(config: dict, family) -> dict:
    """A vision-language release's config.json (``text_config`` and ``vision_config`` nested) as its
    text model's, under the family's ``model_type``: what dist_eval computes (the vision tower is never read).
    """
    text = dict(config["text_config"])
    for key in WHOLE_MODEL_KEYS:
        if key in config:
            text[key] = config[key]
    text["model_type"] = family.model_type
    return text


def _rope_from_parameters(config: dict, where: str, family) -> dict:
    """Move ``rope_parameters`` to ``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor``; the moved values.
    The family's ``inert_rope_keys`` (keys that change nothing on text rows: MRoPE's sections) are set aside; without
    a ``rope_theta`` there, the file's own ``rope_theta``, else the family's default (:func:`default_rope_theta`).
    """
    parameters = _one_rope(config.pop("rope_parameters"), where)
    inert = family.inert_rope_keys if family else ()
    rope = {key: value for key, value in parameters.items() if key not in inert}
    theta = rope.pop("rope_theta", config.get("rope_theta") or default_rope_theta(family))
    moved = {"rope_theta": theta}
    if "partial_rotary_factor" in rope:
        moved["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.get("rope_type", rope.get("type"))
    scaling = None if kind in (None, "default") and not set(rope) - set(_KIND_KEYS) else rope
    moved["rope_scaling"] = scaling
    for name, value in moved.items():
        _agree(config, name, value, where, f"rope_parameters' {name}")
    return moved


def _labelled(parameters, family) -> bool:
    """Whether ``rope_parameters`` is keyed by the family's RoPE kinds (DeepSeek-V4's main and compress)."""
    return isinstance(parameters, dict) and bool(parameters) and set(parameters) <= set(family.rope_labels) and all(
        isinstance(value, dict) for value in parameters.values())


def _rope_by_label(config: dict, labels: tuple, where: str) -> dict:
    """Move ``rope_parameters`` keyed by RoPE kind (``main``: the sliding blocks', no scaling; ``compress``: the
    compressed ones', maybe yarn) to ``rope_theta``, ``compress_rope_theta``, ``partial_rotary_factor`` and
    ``rope_scaling`` (the compressed kinds'); the moved values.
    """
    parameters = config.pop("rope_parameters")
    main, compress = (dict(parameters.get(label) or {}) for label in labels)
    if rope_kind(main) not in (None, "default") or set(main) - {"rope_type", "rope_theta", "partial_rotary_factor"}:
        raise UsageError(f"{where}: rope_parameters' {labels[0]} {json.dumps(main)} scales the sliding blocks' RoPE, "
                         "which no block here computes (transformers 5.x's DeepSeek-V4 does not either).",
                         param="model_dir")
    factors = {part.get("partial_rotary_factor") for part in (main, compress)} - {None}
    if len(factors) > 1 or "rope_theta" not in main or "rope_theta" not in compress:
        raise UsageError(f"{where}: rope_parameters {json.dumps(parameters)} lacks a rope_theta or gives its kinds "
                         "different partial_rotary_factor; the blocks read one of each.", param="model_dir")
    moved = {"rope_theta": main["rope_theta"], "compress_rope_theta": compress.pop("rope_theta")}
    if factors:
        moved["partial_rotary_factor"] = factors.pop()
    compress.pop("partial_rotary_factor", None)
    moved["rope_scaling"] = compress if rope_kind(compress) not in (None, "default") else None
    for name, value in moved.items():
        _agree(config, name, value, where, f"rope_parameters' {name}")
    return moved


def rope_kind(parameters: dict):
    """The RoPE kind of a settings object (``rope_type``, else ``type``)."""
    return parameters.get("rope_type", parameters.get("type"))


def _one_rope(parameters, where: str) -> dict:
    """The RoPE settings of ``rope_parameters``: the object itself, or its per-attention-type form when
    every type has the same settings; else refused.
    """
    if not isinstance(parameters, dict):
        raise UsageError(f"{where}: rope_parameters is {json.dumps(parameters)}, not an object of RoPE settings "
                         "(transformers 5.x's form). Save the model again with transformers.", param="model_dir")
    nested = [value for value in parameters.values() if isinstance(value, dict)]
    if not nested:
        return parameters
    if len(nested) == len(parameters) and all(value == nested[0] for value in nested):
        return nested[0]
    raise UsageError(f"{where}: rope_parameters gives each attention type its own RoPE "
                     f"({', '.join(sorted(map(str, parameters)))}), which no block here computes.", param="model_dir")


def _agree(config: dict, name: str, value, where: str, source: str) -> None:
    """Set ``config[name]`` to ``value``; refused when the file already says otherwise there."""
    if name in config and config[name] is not None and config[name] != value:
        raise UsageError(f"{where}: {name} {json.dumps(config[name])} and {source} {json.dumps(value)} differ; "
                         "which one the model was trained with is not known. Keep one of them.", param="model_dir")
    config[name] = value


def _check_rope_keys(scaling, field: str, where: str) -> None:
    """Refuse a RoPE setting of a kind computed here with a key its computation does not read."""
    if not isinstance(scaling, dict):
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    unread = sorted(set(scaling) - set(_KIND_KEYS) - set(ROPE_KEYS.get(kind, scaling)))
    if unread:
        raise UsageError(f"{where}: {field} of rope_type {kind!r} has {', '.join(unread)}, which its computation "
                         f"here does not read (it reads {', '.join(ROPE_KEYS[kind]) or 'nothing more'}); the "
                         "numbers would differ from the model's.", param="model_dir")


def _read_layer_types(config: dict, family, where: str) -> None:
    """Check ``layer_types`` against what the family's blocks compute; a sliding layer turns its window on."""
    types = config.get("layer_types")
    if types is None:
        return
    if isinstance(types, list):
        types = config["layer_types"] = [LEGACY_LAYER_TYPES.get(kind, kind) for kind in types]
    computed = LAYER_TYPES_READ + family.layer_types
    if not isinstance(types, list) or any(kind not in computed for kind in types):
        unknown = sorted({str(kind) for kind in types} - set(computed)) if isinstance(types, list) else [str(types)]
        raise UsageError(f"{where}: layer_types has {', '.join(unknown)}, which the {family.model_type} blocks "
                         f"here do not compute (they compute {', '.join(computed)}).", param="model_dir")
    if "sliding_attention" in types and family.sliding_window and family.sliding_window[1]:
        config[family.sliding_window[1]] = True  # the window's switch: what transformers 5.x reads from layer_types


def transformers_replacements() -> list:
    """The pinned transformers reads config.json through :func:`read_as_saved` (every config class, in
    every process that calls :func:`dist_eval.backends.blocks.register`).
    """
    from transformers import PretrainedConfig

    read = PretrainedConfig._dict_from_json_file.__func__

    @functools.wraps(read)
    def _dict_from_json_file(cls, json_file):
        return read_as_saved(read(cls, json_file), str(json_file))

    return [(PretrainedConfig, "_dict_from_json_file", classmethod(_dict_from_json_file))]


def family_of_folder(model_dir: str):
    """The family of a model folder (its config.json, read in either form), without transformers;
    what no block here computes refused (:func:`dist_eval.backends.families.family_of`).
    """
    return family_of(SimpleNamespace(**read_config_json(model_dir)), model_dir)


def config_reading(config) -> dict:
    """What the row store's key takes of how ``config`` (a transformers config) was read from config.json:
    ``config_read_as`` (:func:`read_as`) and ``config_defaults_filled`` (:func:`_fill_defaults`), each only where
    there is one (the keys of other folders as they were).
    """
    reading = {"config_read_as": read_as(config), "config_defaults_filled": getattr(config, DEFAULTS_FILLED, None)}
    return {name: dict(value) for name, value in reading.items() if value}


def read_as(config) -> Optional[dict]:
    """The fields ``config`` (a transformers config or a dict) had in the 5.x form, 4.x-form values; None if none."""
    moved = config.get(READ_AS) if isinstance(config, dict) else getattr(config, READ_AS, None)
    return dict(moved) if moved else None


# What of config.json decides the RoPE a block computes, compared between a client's file and each of its servers'
# (a server dist_eval starts announces its own: dist_eval.swarm.server.announcing_numerics): a release's file edited
# on one side (its model card's yarn for long context) is another model's numbers on every block, not a bit apart.
# The first two have a value whether a file gives one or not (the family's base; none); the others are compared
# where both files give them (left out, each reads as its class's default, which differs between families).
ROPE_ALWAYS = ("rope_theta", "rope_scaling")
ROPE_WHERE_GIVEN = ("partial_rotary_factor", "compress_rope_theta", "max_position_embeddings")
# the key of a server's announcement (petals' ServerInfo, extra_info) holding its rope_settings: dist_eval's servers
# add it, a client keeps it (backends.petals.audit.announced_numerics_replacements) and compares
# (backends.petals.failover.leave_out_other_rope)
ROPE_KEY = "dist_eval_rope"


def with_top_level_length(config, scaling: Optional[dict]) -> Optional[dict]:
    """``scaling`` (config.json's llama3 or yarn settings) with config.json's top-level
    ``original_max_position_embeddings`` where it has one: transformers 5.x reads that one before the settings' own
    (Phi-3's layout), where the settings are one for every layer (not those kept by label: Family.rope_labels).
    """
    length = getattr(config, "original_max_position_embeddings", None)
    family = family_named(getattr(config, "model_type", None))
    if not scaling or not length or (family is not None and family.rope_labels):
        return scaling
    return {**scaling, "original_max_position_embeddings": length}


def rope_settings(config: dict) -> dict:
    """The RoPE settings of ``config`` (:func:`read_as_saved`'s dict, either generation's file) as the blocks read
    them, in JSON values: ``rope_theta`` and ``rope_scaling`` always (the family's default base; None for no
    scaling, whichever way a file says it; a llama3 or yarn scaling's original length where the blocks take it: the
    top-level one first, for yarn else ``max_position_embeddings``, as transformers 5.x writes it into the settings
    it saves), the others of :data:`ROPE_WHERE_GIVEN` where the file gives them (``max_position_embeddings`` only
    where the scaling reads it: dynamic; yarn without a factor).
    """
    family = family_named(config.get("model_type"))
    scaling = config.get("rope_scaling") or None
    if isinstance(scaling, dict):
        scaling = {("rope_type" if key == "type" else key): value for key, value in scaling.items()}
        if scaling.get("rope_type") in (None, "default") and not set(scaling) - {"rope_type"}:
            scaling = None
    kind = rope_kind(scaling or {})
    if kind in ("llama3", "yarn"):  # the original length the blocks take
        scaling = with_top_level_length(SimpleNamespace(**config), scaling)
        if kind == "yarn" and not scaling.get("original_max_position_embeddings") and not (
                family is not None and family.rope_labels):
            scaling = {**scaling, "original_max_position_embeddings": config.get("max_position_embeddings")}
    settings = {"rope_theta": config.get("rope_theta") or default_rope_theta(family), "rope_scaling": scaling}
    for name in ROPE_WHERE_GIVEN:
        reads = name != "max_position_embeddings" or kind == "dynamic" or (kind == "yarn" and not scaling.get("factor"))
        if config.get(name) is not None and reads:
            settings[name] = config[name]
    return settings


def rope_differences(ours: dict, theirs: dict) -> list:
    """The names of the :func:`rope_settings` two files disagree on (a setting one of them leaves out is not)."""
    return [name for name in (*ROPE_ALWAYS, *ROPE_WHERE_GIVEN)
            if (name in ROPE_ALWAYS or (name in ours and name in theirs)) and ours.get(name) != theirs.get(name)]
