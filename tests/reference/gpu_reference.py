"""A current transformers' own float32, float16 and bfloat16 forwards of the reference's tiny models, on a device.

    python3 tests/reference/gpu_reference.py OUT [DEVICE]     # OUT: made by make_reference.py; DEVICE: cuda

Run in the reference's environment (a current transformers: on the GPU machine its own, without the Petals
stack's transformers 4.33 on the path), after make_reference.py OUT. For every case of OUT/reference.json
(every family but kimi_k2, DeepSeek-V3's block under its own name): the model as that transformers loads it in
each dtype (``from_pretrained(dtype=...)``, its own kernels on DEVICE), the trained head and prompts cast to
that dtype, each row of the corpus alone (no padding), the logits without prompts (head) and with them
(ptune; None for a family that routes by token id, make_reference.py's HASH_ROUTED), as make_reference.py
computes them in float32 on the CPU. Writes OUT/device_reference.json:
{"versions", "device", "cases": {kind: {dtype: {"logits_head", "logits_ptune"} or {"error"}}}}: "error" where that
transformers' own forward raised. Nothing here imports dist_eval.
"""
import json
import os
import sys

import torch

DTYPES = ("float32", "float16", "bfloat16")


def load(cls, folder: str, dtype, **kwargs):
    try:
        return cls.from_pretrained(folder, dtype=dtype, **kwargs)
    except TypeError:  # a transformers before 4.56 names it torch_dtype
        return cls.from_pretrained(folder, torch_dtype=dtype, **kwargs)


def logits_of(out: str, kind: str, case: dict, dtype_name: str, device: str) -> dict:
    import transformers
    from safetensors.torch import load_file

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import make_reference
    from make_reference import CLASSES, NO_CLASSIFIER

    vision_language = getattr(make_reference, "VISION_LANGUAGE", ())
    hash_routed = getattr(make_reference, "HASH_ROUTED", ())  # no token id at a prompt position: no ptune
    dtype, name = getattr(torch, dtype_name), CLASSES[kind]
    folder = os.path.join(out, case["folder"])
    trainable = {k: v.to(device=device, dtype=dtype)
                 for k, v in load_file(os.path.join(out, f"{kind}.trainable.safetensors")).items()}
    if kind in vision_language:  # saved from *ForConditionalGeneration: its text model
        lm = load(getattr(transformers, f"{name}ForConditionalGeneration"), folder, dtype).to(device).eval()
        backbone = lm.model.language_model
        score = lambda hidden: hidden @ trainable["score.weight"].T  # noqa: E731
    elif kind in NO_CLASSIFIER:
        backbone = load(getattr(transformers, f"{name}ForCausalLM"), folder, dtype).to(device).eval().model
        score = lambda hidden: hidden @ trainable["score.weight"].T  # noqa: E731
    else:
        clf = load(getattr(transformers, f"{name}ForSequenceClassification"), folder, dtype,
                   num_labels=case["num_labels"]).to(device).eval()
        clf.score.weight.data.copy_(trainable["score.weight"])
        backbone, score = clf.base_model, clf.score
    head, ptune = [], []
    with torch.no_grad():
        for row in case["ids"]:
            x = torch.tensor([row], device=device)
            head.append(score(backbone(input_ids=x).last_hidden_state[0, -1]).float().tolist())
            if kind in hash_routed:  # as make_reference.py: None (its first blocks route by token id)
                ptune.append(None)
                continue
            embeds = torch.cat([trainable["prompt_embeddings.weight"][None], backbone.get_input_embeddings()(x)], dim=1)
            ptune.append(score(backbone(inputs_embeds=embeds).last_hidden_state[0, -1]).float().tolist())
    return {"logits_head": head, "logits_ptune": ptune}


def attempt(out: str, kind: str, case: dict, dtype_name: str, device: str) -> dict:
    """logits_of, or {"error": what this transformers raised}: a family it cannot run in that dtype on the device
    (transformers 5.17's DeepSeek-V4 in float16: a module it keeps in float32 feeds a half one) has no bound to
    compare with, which tests/test_gpu.py reports; the other families still get theirs."""
    try:
        return logits_of(out, kind, case, dtype_name, device)
    except Exception as e:  # noqa: BLE001 (any failure of that transformers' own forward)
        print(f"gpu_reference: {kind} in {dtype_name} on {device}: {type(e).__name__}: {e}", file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"[:1000]}


def main(out: str, device: str = "cuda") -> None:
    import transformers

    with open(os.path.join(out, "reference.json"), encoding="utf-8") as f:
        ref = json.load(f)
    cases = {kind: {dtype: attempt(out, kind, case, dtype, device) for dtype in DTYPES}
             for kind, case in ref["cases"].items() if kind != "kimi_k2"}
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else device
    result = {"versions": {"transformers": transformers.__version__, "torch": torch.__version__},
              "device": device, "device_name": name, "cases": cases}
    with open(os.path.join(out, "device_reference.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
