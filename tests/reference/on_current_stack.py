"""dist_eval's local backend run in a reference environment (transformers 5.x: ``.venv-reference5``), issue 71's
first steps toward a current stack: for the given families, ``load_model("local", ...)`` of the reference's
folder with its trained head computes the reference's rows; and the tokenizing fast path's ids against the
reference tokenizer's own call. Prints one JSON object: {family: max |logit - reference| or "ErrorType:
message"}, and "token_ids_equal": bool.

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
    case = ref["cases"][kinds[0]]
    tokenizer = load_tokenizer(os.path.join(out, case["folder"]))
    texts = ref["corpus"]
    found["token_ids_equal"] = _token_ids(tokenizer, texts, None, frozenset()) == tokenizer(texts)["input_ids"]
    return found


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])))
