"""The blocks dist_eval computes beyond the pinned transformers' (4.33) and petals 2.2.0's.

The families after 2023 that dist_eval serves are built on an older family's block with a
few options (the family table's ``built_on`` and ``block_options``,
:mod:`dist_eval.backends.families`): q/k/v projections with biases, rotary frequencies
rescaled by the ``llama3`` rule, and (option ``own_layers``) layers of dist_eval's own
(:mod:`dist_eval.backends.layers`: per-head q/k norms, a head size of its own, partial RoPE,
mixtures of experts). Everything here reads the table; no family is named.

Three things make a folder saved by a current transformers computable by the pinned one,
each applied once per process by :func:`register` (client ranks, the local backend and the
servers dist_eval starts alike, so the swarm computes what ``--backend local`` computes):

1. **Configs.** The base config class reads config.json's ``rope_scaling`` in every format
   (``{"rope_type": ...}`` with extra keys, as saved since transformers 4.43): ``default``
   is no scaling, ``linear`` and ``dynamic`` go to the pinned code's own, and ``llama3`` is
   kept as ``rope_llama3`` (the pinned class refuses it) for the block, and ``yarn`` as
   ``rope_yarn`` for a family with dist_eval's own layers. What no block here
   computes is refused earlier, from config.json alone (:func:`dist_eval.backends.families.family_of`).
2. **The block.** After the base attention's ``__init__``: the ``llama3`` frequencies
   (:mod:`dist_eval.backends.rope`, the rule of transformers >= 4.43) with the cos/sin cache rebuilt from them.
   petals' server block derives from the same attention class, so it gets the same options. A family with
   ``own_layers`` has layers of its own instead, the same in both (the local classes build them
   in place of the base family's, petals' config names their block class; a server tells a block its
   index, :func:`dist_eval.swarm.blocks.server_block_replacements`).
3. **Classes.** For each family built on another, subclasses of the other's config, local
   (transformers) and petals classes with this family's ``model_type``, registered with
   transformers' ``AutoConfig`` and, when petals is imported, petals' own registry (the
   server finds its block class there).

How a server dist_eval starts builds and reads its blocks (each knowing its index, quantized tensors dequantized
as petals reads them) is :mod:`dist_eval.swarm.blocks`.
"""
from __future__ import annotations

import functools
import threading
from typing import Dict, Optional

from dist_eval.backends.compat import class_at, computes_llama3_itself, configs_are_dataclasses
from dist_eval.backends.config_json import with_top_level_length
from dist_eval.backends.rope import rescale_rope

# what the servers dist_eval starts add to the petals version they announce: they compute the
# block options here (a stock petals server would run a newer family's blocks without them)
# (blocks2: config.json read in either transformers generation's form, a server rotary table at its
# rope_theta (Family.server_rotary_attention); a blocks1 server computed neither, so it counts as another's;
# blocks3: a sigmoid router never chooses an expert outside its kept groups (-inf, transformers 5.x's rule,
# Family.computation_revision), where a blocks2 server set its score to 0 (4.x's): it counts as another's too)
SERVER_VERSION_MARK = "+dist_eval.blocks3"
_lock = threading.RLock()
_classes: Dict[str, type] = {}  # class name -> class built here


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def pinned_rope_scaling(rope_scaling: Optional[dict]) -> tuple:
    """(what the pinned config class accepts as ``rope_scaling``, the ``llama3`` settings or None)
    of config.json's ``rope_scaling`` in any format.
    """
    from dist_eval.backends.families import rope_type

    if not isinstance(rope_scaling, dict):
        return rope_scaling, None
    kind = rope_type(rope_scaling)
    if kind in (None, "default"):
        return None, None
    if kind == "llama3":
        return None, {key: rope_scaling[key] for key in LLAMA3_KEYS}
    if kind in ("linear", "dynamic"):
        return {"type": kind, "factor": rope_scaling["factor"]}, None
    return rope_scaling, None  # the pinned class refuses it, as before (family_of refuses it first)


# the blocks whose RoPE computes yarn itself (dist_eval's own layers: their rotary table, the latent attention's,
# gpt-oss's, DeepSeek-V4's): rope_yarn; what of them does not is refused from config.json (families.rope_types_computed)
YARN_BLOCK_OPTIONS = ("own_layers", "latent_attention", "sink_attention", "hyper_connections")


def _config_init(original):
    @functools.wraps(original)
    def __init__(self, *args, rope_scaling=None, rope_llama3=None, rope_yarn=None, **kwargs):
        from dist_eval.backends.families import rope_type

        yarn = None
        if _yarn_blocks(self) and rope_type(rope_scaling) == "yarn":
            yarn, rope_scaling = dict(rope_scaling), None
        pinned, llama3 = pinned_rope_scaling(rope_scaling)
        if llama3 and computes_llama3_itself():  # transformers >= 4.43 computes llama3 from the config's own
            pinned = rope_scaling
        original(self, *args, rope_scaling=pinned, **kwargs)
        self.rope_llama3 = with_top_level_length(self, llama3 or rope_llama3)  # also when read back from a save here
        self.rope_yarn = with_top_level_length(self, yarn or rope_yarn)
        rope_fields_from_parameters(self)
    return __init__


def _yarn_blocks(config) -> bool:
    return any(getattr(config, option, False) for option in YARN_BLOCK_OPTIONS)


# what transformers 5.x's config classes move into ``rope_parameters``, read by the blocks here where 4.x keeps
# them: a partial_rotary_factor looked for on the config and not found reads as 1.0 (every value of a head
# rotated, no word), a rope_theta as an AttributeError
MOVED_INTO_ROPE_PARAMETERS = ("rope_theta", "partial_rotary_factor")


def rope_fields_from_parameters(config) -> None:
    """The RoPE fields the blocks here read (``rope_theta``, ``partial_rotary_factor``, ``rope_llama3``,
    ``rope_yarn``: 4.x's places), set from ``config.rope_parameters``, where transformers >= 5.0 keeps them all;
    nothing on an older transformers (no ``rope_parameters``) or where a field is set already.
    """
    parameters = getattr(config, "rope_parameters", None)
    if not isinstance(parameters, dict):
        return
    for name in MOVED_INTO_ROPE_PARAMETERS:
        if name in parameters and name not in vars(config):
            setattr(config, name, parameters[name])
    kind = parameters.get("rope_type")
    if kind == "llama3" and not getattr(config, "rope_llama3", None):
        config.rope_llama3 = with_top_level_length(config, {key: parameters[key] for key in LLAMA3_KEYS})
    if kind == "yarn" and _yarn_blocks(config) and not getattr(config, "rope_yarn", None):
        config.rope_yarn = with_top_level_length(config, {
            key: value for key, value in parameters.items() if key not in MOVED_INTO_ROPE_PARAMETERS})


def _subclass_post_init(base_config):
    """The ``__post_init__`` of a config subclass built on ``base_config`` (transformers >= 5.0): the base's, then
    the RoPE fields from ``rope_parameters``. Such a transformers makes each config subclass a dataclass with an
    ``__init__`` of its own, so the base's ``__init__`` with the options (:func:`_config_init`) does not run for it.
    """
    def __post_init__(self, **kwargs):
        base_config.__post_init__(self, **kwargs)
        rope_fields_from_parameters(self)
    return __post_init__


def _dataclass_config_body(base_config, options: tuple) -> dict:
    """What a config subclass built on ``base_config`` with the block ``options`` overrides on transformers >= 5.0:
    its ``__post_init__`` (:func:`_subclass_post_init`), the options that are fields of ``base_config`` declared
    again (:func:`_option_fields`), and the strict-dataclass validation its saves run, each validator resolved on the
    subclass (huggingface_hub's ``validate`` calls the functions of the class it decorated, never an override), with
    ``validate_layer_type`` a no-op: the kinds of a family built on another are checked from config.json by
    :func:`~dist_eval.backends.families.family_of` (the family table's ``layer_types``, the block's own refusal);
    the base's validator knows its own kinds alone (DeepSeek-V4's ``mlp_layer_types`` hash_moe failed every save).
    """
    def validate(self):
        names = {validator.__name__ for klass in type(self).__mro__
                 for validator in vars(klass).get("__class_validators__", ())}
        for name in sorted(names):
            getattr(self, name)()

    validate.__is_defined_by_strict_decorator__ = True  # a strict subclass puts its own in place, as of a parent's
    return {"__post_init__": _subclass_post_init(base_config), "validate": validate,
            "validate_layer_type": lambda self: None, "__annotations__": _option_fields(base_config, options)}


def _option_fields(base_config, options: tuple) -> dict:
    """The annotations (the base's types) that make each of ``options`` that is a dataclass field of ``base_config``
    (transformers >= 5.0) a field of the subclass with the option as its default. transformers makes the subclass a
    dataclass, whose ``__init__`` sets every field it inherits to the base's default: a class attribute alone is
    shadowed (a ``head_dim`` option read as hidden_size / heads where config.json leaves head_dim out).
    """
    import dataclasses

    fields = {field.name: field for field in dataclasses.fields(base_config)}
    return {name: fields[name].type for name, _ in options if name in fields}


def _attention_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        apply_block_options(self, config)
    return __init__


def apply_block_options(attention, config) -> None:
    """Give a base attention module built for ``config`` the options the config asks for (the ``llama3``
    frequencies).
    """
    rescale_rope(attention, config, computes_llama3_itself())


def register() -> None:
    """Apply the config and block options and build every family's classes (transformers
    side; petals' too when petals is imported). Idempotent; every process calls it before it
    reads a config or builds a model.
    """
    import sys

    from dist_eval.backends import config_json
    from dist_eval.backends.families import FAMILIES
    from dist_eval.backends.petals.shims import apply

    with _lock:
        apply("config_forms", "both", config_json.transformers_replacements)  # either generation's config.json
        for family in FAMILIES.values():
            if family.attention_class:
                apply(f"block_options_{family.model_type}", "both",
                      lambda f=family: _option_replacements(f))
        for family in FAMILIES.values():
            if family.built_on:
                _build_transformers_classes(family)
        if "petals" in sys.modules:
            for family in FAMILIES.values():
                if family.built_on:
                    _build_petals_classes(family)
                if family.server_rotary_attention:
                    apply(f"server_rotary_{family.model_type}", "both",
                          lambda f=family: _server_rotary_replacements(f))


def _option_replacements(family) -> list:
    config_cls, attention_cls = class_at(family.config_class), class_at(family.attention_class)
    return [(config_cls, "__init__", _config_init(config_cls.__init__)),
            (attention_cls, "__init__", _attention_init(attention_cls.__init__))]


def _server_rotary_replacements(family) -> list:
    """Petals' server attention of ``family`` (``Family.server_rotary_attention``) with its rotary table at
    config.json's ``rope_theta``, as transformers computes it (petals 2.2 builds it at base 10000 always).
    """
    attention_cls = class_at(family.server_rotary_attention)
    original = attention_cls.__init__

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        if getattr(config, "rotary", False):
            rope_fields_from_parameters(config)  # 5.x keeps rope_theta in rope_parameters only
            self.maybe_rotary = type(self.maybe_rotary)(config.head_dim, base=getattr(config, "rope_theta", 10000.0))

    return [(attention_cls, "__init__", __init__)]


def _build_transformers_classes(family) -> None:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family.model_type in _classes:
        return
    base = _base(family)
    base_config = class_at(base.config_class)
    body = {"model_type": family.model_type, **dict(family.block_options)}
    if configs_are_dataclasses():
        body.update(_dataclass_config_body(base_config, family.block_options))
    config = type(_config_name(family), (base_config,), body)
    _classes[family.model_type] = config
    # a later transformers has the family itself (mistral since 4.34): its Auto classes stay its own (they refuse
    # a second of the name), and ours are reached by name (family_class), as everywhere in dist_eval
    native = family.model_type in CONFIG_MAPPING
    if not native:
        transformers.AutoConfig.register(family.model_type, config)
    from dist_eval.backends.layers import layers_return_tensors, own_layers_init

    # every family built here, own layers or not (a 4.33-saved folder has 4.x fields)
    backbone = _register_base_backbone(family, base, config) if layers_return_tensors() else None
    autos = (transformers.AutoModelForSequenceClassification, transformers.AutoModelForCausalLM)
    for name, base_name, auto in zip((family.local_class, family.local_lm_class),
                                     (base.local_class, base.local_lm_class), autos):
        base_class = getattr(transformers, base_name)
        init = own_layers_init(base_class) if has_own_layers(family) else base_class.__init__
        body = {"config_class": config, "__init__": _with_backbone(init, backbone) if backbone else init}
        _classes[name] = type(name, (base_class,), body)
        if not native:
            auto.register(config, _classes[name])


def _register_base_backbone(family, base, config) -> type:
    """Where transformers' head classes build their backbone by ``AutoModel.from_config`` (5.x; 4.57 shares its layer
    API, the test of :func:`~dist_eval.backends.layers.layers_return_tensors`), which finds a model by
    the config class's name: 5.x's own model of the family where it has one (another forward, another layer call, other
    config fields: a folder the pinned transformers saved, such as the demo's, has no ``layer_types``), none where it
    has not. Every family built here takes the base family's backbone, as the pinned head classes build it:
    registered for its config class, and returned.
    """
    import transformers

    backbone = getattr(transformers, base.local_class.replace("ForSequenceClassification", "Model"))
    body = {"config_class": config}
    if family.hyper_connected:  # output_hidden_states: 5.x records the outputs of the layers of this class
        from dist_eval.backends.layers import HyperConnectedLayer

        body["_can_record_outputs"] = {**(backbone._can_record_outputs or {}), "hidden_states": HyperConnectedLayer}
    own = type(_config_name(family).replace("Config", "Model"), (backbone,), body)
    transformers.AutoModel.register(config, own, exist_ok=True)
    return own


def _with_backbone(init, backbone: type):
    """``init`` (a head class's ``__init__``), then its backbone made of the class ``backbone`` (the base family's,
    :func:`_register_base_backbone`) where ``init`` built the base family's own: the causal LM's (transformers' head
    classes other than the classifier build their base model by its class). 5.x reads a checkpoint into a model of its
    own classes through the conversions of the config's ``model_type`` (that family's names in 5.x's own model, its
    experts merged: a release's names were read as 5.x's, which dist_eval's layers do not have); a class of
    dist_eval's own is read as saved, as the classifier's backbone is.
    """
    @functools.wraps(init)
    def __init__(self, config, *args, **kwargs):
        init(self, config, *args, **kwargs)
        if type(self.base_model) in backbone.__bases__:  # the same modules: only its class is dist_eval's
            self.base_model.__class__ = backbone

    return __init__


def _build_petals_classes(family) -> None:
    import petals
    from petals.utils.auto_config import _CLASS_MAPPING, register_model_classes

    if family.model_type in _CLASS_MAPPING:
        return
    base = _base(family)
    base_config = getattr(petals, "Distributed" + _config_name(base))
    body = {"model_type": family.model_type, **dict(family.block_options)}
    if configs_are_dataclasses():  # the RoPE fields from rope_parameters, as the transformers classes' (5.x)
        body.update(_dataclass_config_body(base_config, family.block_options))
    if family.hyper_connected:  # DeepSeek-V4's block and attention (petals counts heads)
        from dist_eval.backends.layers import HyperConnectedServerBlock, V4Attention

        body.update(block_class=HyperConnectedServerBlock, attn_class=V4Attention)
    elif has_own_layers(family):  # the server's block (its attention is still a config.attn_class)
        from dist_eval.backends.layers import petals_block_class

        body["block_class"] = petals_block_class()
    config = type("Distributed" + _config_name(family), (base_config,), body)
    built = {}
    for name, base_name in ((family.petals_class, base.petals_class), (family.petals_lm_class, base.petals_lm_class)):
        body = {"config_class": config}
        if has_own_layers(family):  # the client's final norm, where the family's is not the base one's
            body["__init__"] = _own_final_norm_init(getattr(petals, base_name))
        built[name] = _classes[name] = type(name, (getattr(petals, base_name),), body)
    register_model_classes(config=config, model_for_causal_lm=built[family.petals_lm_class],
                           model_for_sequence_classification=built[family.petals_class])


def _own_final_norm_init(base: type):
    """An ``__init__`` for a subclass of petals' ``base`` (its blocks on the swarm, the final norm here):
    ``base``'s own, then the family's final norm in place of the base family's
    (:func:`dist_eval.backends.layers.own_final_norm`); DeepSeek-V4's, hc_head, its final norm and the streams
    made before the first server (:func:`dist_eval.backends.layers.build_hyper_connected_client`).
    """
    def __init__(self, config, *args, **kwargs):
        from dist_eval.backends.layers import build_hyper_connected_client, own_final_norm

        base.__init__(self, config, *args, **kwargs)
        if getattr(config, "hyper_connections", False):
            build_hyper_connected_client(self.base_model, config)
            return
        norm = own_final_norm(config)
        if norm is not None:
            self.base_model.norm = norm

    __init__.__qualname__ = f"{base.__name__}.__init__ (dist_eval's final norm)"
    return __init__


def _base(family):
    from dist_eval.backends.families import FAMILIES

    return FAMILIES[family.built_on]


def _config_name(family) -> str:
    return family.local_class.replace("ForSequenceClassification", "Config")


def family_class(name: str, in_petals: bool):
    """The class ``name`` of a family: petals' or transformers' own, or one built here."""
    if in_petals:
        from dist_eval.backends.petals.shims import import_petals

        module = import_petals()  # registers petals' side too
    else:
        import transformers as module
    register()
    return _classes[name] if name in _classes else getattr(module, name)


def has_own_layers(family) -> bool:
    """Whether the family's blocks are dist_eval's own layers (:mod:`dist_eval.backends.layers`)."""
    return bool(dict(family.block_options).get("own_layers"))


def needs_block_options(family, config) -> bool:
    """Whether ``config`` of ``family`` is computed only by this module's block options."""
    return bool(family.built_on or getattr(config, "rope_llama3", None))
