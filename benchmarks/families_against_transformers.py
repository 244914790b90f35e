"""Every family's --backend local logits against the transformers that saved the folder, both generations.

    ./launch/install_reference.sh && ./launch/install_reference.sh 5
    .venv/bin/python benchmarks/families_against_transformers.py [OUT]

Makes the suite's reference folders (tests/reference/make_reference.py) with transformers 4.57 and with 5.x
(config.json in each one's form), loads each with dist_eval's local backend and prints, per family and
generation, the largest |logit difference| over the 16 rows of the reference corpus, with the trained head
alone and with the prompts prepended (ptune). The suite's bound is 1e-4 (tests/test_families_reference.py).
"""
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENVS = {"4": ".venv-reference", "5": ".venv-reference5"}


def make(generation: str, out: str) -> dict:
    python = os.path.join(REPO, VENVS[generation], "bin", "python")
    subprocess.run([python, os.path.join(REPO, "tests", "reference", "make_reference.py"), out], check=True,
                   capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    with open(os.path.join(out, "reference.json"), encoding="utf-8") as f:
        return json.load(f)


def differences(out: str, kind: str, case: dict) -> dict:
    """{mode: max |dist_eval's local logits - the reference's|} for the head alone and ptune."""
    import torch
    from safetensors.torch import load_file, save_file

    from dist_eval.backends import load_model

    tensors = load_file(os.path.join(out, f"{kind}.trainable.safetensors"))
    longest = max(map(len, case["ids"]))
    batch = torch.tensor([row + [case["pad_token_id"]] * (longest - len(row)) for row in case["ids"]])
    head, prompts = os.path.join(out, f"{kind}.head.safetensors"), os.path.join(out, f"{kind}.prompts.safetensors")
    save_file({"score.weight": tensors["score.weight"]}, head)
    save_file({"prompt_embeddings.weight": tensors["prompt_embeddings.weight"]}, prompts)
    found = {}
    for mode, files in (("head", {"head": head}), ("ptune", {"checkpoint": prompts, "head": head})):
        model = load_model("local", os.path.join(out, case["folder"]), **files)
        with torch.no_grad():
            logits = model.module(batch)
        found[mode] = (logits - torch.tensor(case[f"logits_{mode}"])).abs().max().item()
    return found


def main(out: str) -> None:
    import torch

    torch.set_num_threads(1)
    rows = {}
    versions = {}
    for generation in VENVS:
        folder = os.path.join(out, generation)
        ref = make(generation, folder)
        versions[generation] = ref["versions"]["transformers"]
        for kind, case in ref["cases"].items():
            rows.setdefault(kind, {})[generation] = differences(folder, kind, case)
    print(f"| family | transformers {versions['4']}: head | ptune | transformers {versions['5']}: head | ptune |")
    print("|---|---|---|---|---|")
    for kind, by_generation in rows.items():
        cells = [f"{by_generation[g][mode]:.1e}" if g in by_generation else "-"  # a family of 5.x alone (Qwen3.5)
                 for g in VENVS for mode in ("head", "ptune")]
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="families-"))
