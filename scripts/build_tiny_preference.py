"""Build `ftcli/assets/tiny_prefs.jsonl`: preference pairs on the tasks of tiny_chat.jsonl (deterministic).

The chosen answer is the right one, the rejected a wrong one of the same shape (another capital, a wrong
sum, a miscount, letters in the wrong order, a dropped word), so a tiny model can learn the preference in a
few CPU steps. Rows come in every form `ftcli.data.preference` reads: TRL's conversational form (most rows:
a message-list prompt, some multi-turn or with a system turn), its standard form (strings), implicit-prompt
conversations with a `prompt` string beside them (UltraFeedback binarized's shape) and hh-rlhf transcripts.
The existing assets are not touched.

    python scripts/build_tiny_preference.py
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_assets import ASSETS, CAPITALS, SYSTEMS, task  # noqa: E402

ROWS = 600


def wrong(rng: random.Random, prompt: str, answer: str) -> str:
    """A wrong answer of the same shape as `answer`."""
    if prompt.startswith("What is the capital of"):
        country = prompt[len("What is the capital of "):-1]
        other = rng.choice([c for c in CAPITALS.values() if c != CAPITALS[country]])
        return f"The capital of {country} is {other}."
    if prompt.startswith("What is") and "plus" in prompt:
        a, b = (int(x) for x in prompt[len("What is "):-1].split(" plus "))
        return f"{a} plus {b} is {a + b + rng.choice([-2, -1, 1, 2, 3])}."
    if prompt.startswith("Count from 1 to"):
        n = int(prompt.split()[-1].rstrip("."))
        return " ".join(str(i) for i in range(1, n + rng.choice([0, 2])) if i != rng.randint(2, n))
    words = answer.split()
    shuffled = words[1:] + words[:1] if len(words) > 1 else words + words
    return " ".join(shuffled)


def row(rng: random.Random) -> dict:
    history = []
    if rng.random() < 0.2:
        history.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(rng.choice([0, 0, 0, 1])):  # multi-turn prompts: earlier answered turns
        user, assistant = task(rng)
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    user, answer = task(rng)
    bad = wrong(rng, user, answer)
    prompt = [*history, {"role": "user", "content": user}]
    form = rng.random()
    if form < 0.6:  # TRL conversational
        return {"prompt": prompt, "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": bad}]}
    if form < 0.75:  # TRL standard (strings)
        return {"prompt": user, "chosen": answer, "rejected": bad}
    if form < 0.9:  # UltraFeedback binarized: prompt string + full conversations
        return {"prompt": user, "chosen": [*prompt, {"role": "assistant", "content": answer}],
                "rejected": [*prompt, {"role": "assistant", "content": bad}]}
    return {"chosen": f"\n\nHuman: {user}\n\nAssistant: {answer}",  # hh-rlhf
            "rejected": f"\n\nHuman: {user}\n\nAssistant: {bad}"}


def main() -> None:
    rng = random.Random(41)
    with open(ASSETS / "tiny_prefs.jsonl", "w") as f:
        for _ in range(ROWS):
            f.write(json.dumps(row(rng)) + "\n")


if __name__ == "__main__":
    main()
