"""A controller process for the kill-and-resume test: solves one task with its state in Redis ($REDIS_URL),
appending each finished chunk's sample indices to $CHUNK_LOG. Run twice with the same task id."""

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_controller import HARD, KV_PER_TOKEN, ids, profile  # noqa: E402

from orchestrator.controller import Budget, Controller  # noqa: E402
from orchestrator.redis_saver import RedisSaver  # noqa: E402
from workers.local import LocalPool  # noqa: E402
from workers.worker import WorkerConfig  # noqa: E402


def main(task_id: str) -> None:
    log = Path(os.environ["CHUNK_LOG"])

    def on_event(name, data):
        if name == "chunk":
            with log.open("a") as handle:
                handle.write(json.dumps(data["samples"]) + "\n")

    pool = LocalPool(WorkerConfig(kv_budget_bytes=20_000_000, torch_threads=1))
    synthetic = profile(max_new_tokens=200)
    synthetic = synthetic.model_copy(update={"entries": [e.model_copy(update={"threads": 12 if e.threads == 16 else e.threads})
                                                         for e in synthetic.entries if e.cr == 1]})
    controller = Controller(pool, synthetic, KV_PER_TOKEN, [1], threshold=1.01, greedy_first=False,  # never settles
                            checkpointer=RedisSaver.from_url(os.environ["REDIS_URL"]))
    state = asyncio.run(controller.solve(task_id, HARD, ids(HARD), Budget(kv_budget_bytes=20_000_000, max_threads=12), seed=5,
                                         on_event=on_event))
    print(json.dumps({"threads": state["threads"], "answer": state["answer"]}))


if __name__ == "__main__":
    main(sys.argv[1])
