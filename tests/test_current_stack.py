"""dist_eval beside a current transformers (issue 71): the environment ``launch/install_reference.sh 5`` makes
(transformers 5.x, this project installed editable without the extra ``petals``), against the pinned stack of the
suite's own environment. Its own file, so that it runs beside test_families_reference.py (whose references it does
not need) rather than after it.
"""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO
from float_promises import ACROSS_GENERATIONS as TOLERANCE
from float_promises import ROUNDING


@pytest.fixture(scope="module")
def current_stack_python() -> str:
    """The Python of ``.venv-reference5`` (made or found by launch/install_reference.sh 5; a lock makes a second
    caller wait for the first's install)."""
    done = subprocess.run([os.path.join(REPO, "launch", "install_reference.sh"), "5"], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return os.path.join(os.environ.get("DIST_EVAL_REFERENCE5_VENV", os.path.join(REPO, ".venv-reference5")), "bin",
                        "python")


DEMO_RUN = """
import json, os, sys
from datasets import Dataset
import transformers
from dist_eval import evaluate, load_model, load_tokenizer
from dist_eval.demo import make_examples, shipped_families

texts, labels = make_examples(12, seed=5)
found = {"transformers": transformers.__version__}
for family in shipped_families():
    root = os.path.join(sys.argv[1], family)
    tokenizer = load_tokenizer(os.path.join(root, "model"))
    model = load_model("local", os.path.join(root, "model"), checkpoint=os.path.join(root, "checkpoint.pt"))
    result = evaluate(model, Dataset.from_dict({"text": texts, "label": labels}), tokenizer=tokenizer, batch_size=4,
                      bootstrap_resamples=0, return_logits=True)
    found[family] = {"ids": [tokenizer(text)["input_ids"] for text in texts],
                     "logits": {int(i): [float(x) for x in row]
                                for i, row in zip(result.predictions.indices, result.predictions.logits)}}
print(json.dumps(found))
"""


@pytest.mark.multiproc
def test_the_embedded_demo_reads_and_computes_alike_on_transformers_5(current_stack_python):
    """Issue 71: the demo's folders (saved by the pinned transformers, tokenizer_class PreTrainedTokenizerFast) on a
    current stack: each family's token ids equal the pinned stack's and its logits are within TOLERANCE. Before, on
    5.23: qwen2's tokenizer was rebuilt as 5.x's Qwen2Tokenizer (other ids, most unknown: accuracy 0.30 for 1.00,
    without a word), and its model, with mistral's, got 5.x's own backbone (AttributeError: layer_types)."""
    from conftest import run_env, run_in_own_group

    assets = os.path.join(REPO, "dist_eval", "demo_assets")
    runs = []
    for python in (sys.executable, current_stack_python):
        proc = run_in_own_group([python, "-c", DEMO_RUN, assets], timeout=300,
                                env=run_env({"DIST_EVAL_ROW_STORE": "off", "HF_HUB_OFFLINE": "1"}))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    pinned, current = runs
    assert pinned.pop("transformers").startswith("4.33") and current.pop("transformers") == "5.23.0"
    assert sorted(pinned) == sorted(current) == ["bloom", "falcon", "llama", "mistral", "qwen2"]
    for family, expected in pinned.items():
        assert current[family]["ids"] == expected["ids"], family
        assert current[family]["logits"].keys() == expected["logits"].keys()
        found = max(abs(a - b) for i, row in expected["logits"].items()
                    for a, b in zip(row, current[family]["logits"][i]))
        assert found < TOLERANCE, (family, found)
        print(f"{family}: ids equal, logits at most {found:.3g} apart")


DEMO_SWARM_RUN = """
import json, os, sys
from datasets import Dataset
import transformers
from dist_eval import evaluate, load_model, load_tokenizer
from dist_eval.backends.petals.shims import applied
from dist_eval.demo import make_examples
from dist_eval.swarm import LocalSwarm

texts, labels = make_examples(12, seed=5)
found = {"transformers": transformers.__version__}
for family in sys.argv[2:]:
    root = os.path.join(sys.argv[1], family)
    folder, checkpoint = os.path.join(root, "model"), os.path.join(root, "checkpoint.pt")
    tokenizer, rows = load_tokenizer(folder), Dataset.from_dict({"text": texts, "label": labels})
    logits = {}
    with LocalSwarm(folder, num_servers=1, dht_prefix=f"current-stack-{family}") as swarm:
        for backend, where in (("local", {}), ("petals", {"initial_peers": swarm.initial_peers,
                                                          "dht_prefix": swarm.dht_prefix})):
            model = load_model(backend, folder, checkpoint=checkpoint, **where)
            try:
                result = evaluate(model, rows, tokenizer=tokenizer, batch_size=4, bootstrap_resamples=0,
                                  return_logits=True)
            finally:
                model.close()
            logits[backend] = {int(i): [float(x) for x in row]
                               for i, row in zip(result.predictions.indices, result.predictions.logits)}
    found[family] = logits
found["bridges"] = applied()
print(json.dumps(found))
"""


@pytest.mark.swarm
def test_the_demo_on_a_swarm_on_transformers_5_equals_its_local_backend(current_stack_python):
    """Issue 71: petals 2.2's client and dist_eval's servers on transformers 5.23, petals installed beside it with
    --no-deps (launch/install_reference.sh 5) and run through the bridges of backends/petals/shims.py: the demo's
    llama (petals' own attention block, its decoder mask), bloom (petals' block with its cache) and falcon (its
    boolean mask) on a local swarm equal the local backend of the same stack within ROUNDING (petals' blocks are
    another implementation of the same model). Without the bridges petals does not import there (its version
    assert)."""
    from conftest import run_env, run_in_own_group

    assets = os.path.join(REPO, "dist_eval", "demo_assets")
    families = ["llama", "bloom", "falcon"]
    proc = run_in_own_group([current_stack_python, "-c", DEMO_SWARM_RUN, assets, *families], timeout=420,
                            env=run_env({"DIST_EVAL_ROW_STORE": "off", "HF_HUB_OFFLINE": "1"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found.pop("transformers") == "5.23.0"
    bridges = found.pop("bridges")
    # the client's bridges of transformers 5.x, applied in this process (the servers' are their own processes')
    assert {"petals_version_assert", "get_file_from_repo", "client_dht_on_cpu", "prefix_tokens_on_cpu"} <= set(bridges)
    assert sorted(found) == sorted(families)
    for family, logits in found.items():
        local, swarm = logits["local"], logits["petals"]
        assert swarm.keys() == local.keys() and len(local) == 12, family
        worst = max(abs(a - b) / (1 + abs(b)) for i, row in local.items() for a, b in zip(swarm[i], row))
        assert worst <= ROUNDING, (family, worst)
        print(f"{family}: the swarm within {worst:.3g} of local")
