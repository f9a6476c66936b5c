"""Worker: score one batch with the in-process teacher (this run's TP/PP) and with a teacher server.

argv: out_dir model_dir server_url temperature sequences_json (list of [prompt_ids, response_ids]).
Writes both [B, S] logprob tables.
"""

import json
import sys

sys.path.insert(0, __file__.rsplit("/workers/", 1)[0])
from launcher import write_result  # noqa: E402

from megatron_armor.config import MicroBatchingConfig  # noqa: E402
from megatron_armor.convert.loading import load_gpt_model  # noqa: E402
from megatron_armor.data.types import Sample  # noqa: E402
from megatron_armor.distributed.init import destroy_distributed, initialize_distributed  # noqa: E402
from megatron_armor.models.hf_config import load_model_shape  # noqa: E402
from megatron_armor.scoring.batch import build_sequence_batch  # noqa: E402
from megatron_armor.scoring.logprobs import ScoringConfig  # noqa: E402
from megatron_armor.teacher.scorer import InProcessTeacher, RemoteTeacher, TeacherClient  # noqa: E402
from megatron_armor.scoring.micro_batches import MicroBatching  # noqa: E402

out_dir, model_dir, url, temperature, sequences = sys.argv[1:]
temperature = float(temperature)
initialize_distributed(1, 1)
samples = [Sample(prompt_index=i, prompt_ids=p, response_ids=r, engine_logprobs=[0.0] * len(r), finish_reason="stop",
                  is_anchor=False) for i, (p, r) in enumerate(json.loads(sequences))]
batch = build_sequence_batch(samples, [0.0] * len(samples), pad_token_id=0)
model = load_gpt_model(model_dir, load_model_shape(model_dir))
in_process = InProcessTeacher(model, micro_batching=MicroBatching(MicroBatchingConfig(2)),
                              scoring=ScoringConfig(temperature=temperature))
remote = RemoteTeacher(TeacherClient([url]), temperature=temperature)
write_result(out_dir, {"in_process": in_process.score(batch).tolist(), "remote": remote.score(batch).tolist(),
                       "response_mask": batch.response_mask.tolist()})
destroy_distributed()
