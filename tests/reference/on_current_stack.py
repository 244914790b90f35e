"""dist_eval's local backend run in a reference environment (transformers 5.x: ``.venv-reference5``; 4.57:
``.venv-reference``), issue 71's first steps toward a current stack: for the given families,
``load_model("local", ...)`` of the reference's folder with its trained head computes the reference's rows; and
the tokenizing fast path's ids against the reference tokenizer's own call. Prints one JSON object: {family: max
|logit - reference| or "ErrorType: message"}, and "token_ids_equal": bool.

    .venv-reference5/bin/python tests/reference/on_current_stack.py REPO REFERENCE_OUT FAMILY...

Run by tests/test_families_reference.py; the environment holds torch, transformers, tokenizers, safetensors,
numpy and peft, not the project's other packages: what is imported here must not need them.
"""
import json
import os
import sys

import torch


def main(repo: str, out: str, kinds: list) -> dict:
    sys.path.insert(0, repo)
    from safetensors.torch import load_file, save_file

    from dist_eval.backends import load_model
    from dist_eval.backends.tokenizer import load_tokenizer
    from dist_eval.data.tokenize import _token_ids

    torch.set_num_threads(1)
    with open(os.path.join(out, "reference.json"), encoding="utf-8") as f:
        ref = json.load(f)
    found = {}
    for kind in kinds:
        case = ref["cases"][kind]
        head = os.path.join(out, f"{kind}.current-stack-head.safetensors")
        save_file({"score.weight": load_file(os.path.join(out, f"{kind}.trainable.safetensors"))["score.weight"]},
                  head)
        try:
            model = load_model("local", os.path.join(out, case["folder"]), head=head)
            longest = max(map(len, case["ids"]))
            batch = torch.tensor([row + [case["pad_token_id"]] * (longest - len(row)) for row in case["ids"]])
            with torch.no_grad():
                logits = model.module(batch)
            found[kind] = (logits - torch.tensor(case["logits_head"])).abs().max().item()
        except Exception as e:  # noqa: BLE001 - the test names what broke, family by family
            found[kind] = f"{type(e).__name__}: {str(e)[:300]}"
    found["cache_refused"] = _cache_refused(out, ref["cases"]["qwen3"]) if "qwen3" in kinds else None
    case = ref["cases"][kinds[0]]
    tokenizer = load_tokenizer(os.path.join(out, case["folder"]))
    texts = ref["corpus"]
    found["token_ids_equal"] = _token_ids(tokenizer, texts, None, frozenset()) == tokenizer(texts)["input_ids"]
    misread = {kind: _rope_fields_misread(os.path.join(out, ref["cases"][kind]["folder"])) for kind in ref["cases"]}
    found["rope_fields_misread"] = {kind: fields for kind, fields in misread.items() if fields is not None}
    return found


def _cache_refused(out: str, case: dict):
    """dist_eval's own layers keep no cache on 5.x: a forward asking for one must be refused (not given an empty
    cache, which the next step would read as no context), one without use_cache must run (config.use_cache off)."""
    from dist_eval.backends import load_model

    model = load_model("local", os.path.join(out, case["folder"]), head=os.path.join(out, "qwen3.current-stack-head"
                                                                                      ".safetensors"))
    batch = torch.tensor([case["ids"][0]])
    with torch.no_grad():
        model.module.hf_model(batch)
        try:
            model.module.hf_model(batch, use_cache=True)
        except ValueError as e:
            return "use_cache=False" in str(e)
    return False


def _rope_fields_misread(folder: str):
    """The RoPE fields of the family's config class as dist_eval builds it on this transformers (on another
    family's, or the base family's with the options) that differ from config.json as the blocks read it on the
    pinned stack (:func:`read_config_json`: the 4.x form); also for families whose blocks do not run on 5.x yet.
    None for a family whose config class is transformers' own."""
    from dist_eval.backends.blocks import LLAMA3_KEYS, family_class
    from dist_eval.backends.config_json import family_of_folder, read_config_json

    family = family_of_folder(folder)
    if not (family.built_on or family.attention_class):
        return None
    try:
        config = family_class(family.local_class, in_petals=False).config_class.from_pretrained(folder)
        saved = read_config_json(folder)
    except Exception as e:  # noqa: BLE001 - named, family by family
        return [f"{type(e).__name__}: {str(e)[:200]}"]
    scaling = saved.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    expected = {"rope_theta": saved.get("rope_theta"), "partial_rotary_factor": saved.get("partial_rotary_factor", 1.0),
                "rope_llama3": {key: scaling[key] for key in LLAMA3_KEYS} if kind == "llama3" else None,
                "rope_yarn": scaling if kind == "yarn" else None}
    defaults = {"partial_rotary_factor": 1.0}
    found = {name: getattr(config, name, defaults.get(name)) for name in expected}
    return [f"{name}: {found[name]!r}, config.json {value!r}" for name, value in expected.items()
            if found[name] != value]


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])))
