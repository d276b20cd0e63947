set -x
nvidia-smi --query-gpu=name,memory.total --format=csv
python -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
export PYTHONPATH=$PWD
python - <<'PY'
import json, random
from worker.demo import make_model
make_model("/tmp/m", arch="qwen3")
random.seed(1)
rows = [[random.randrange(1, 400) for _ in range(random.randrange(20, 300))] for _ in range(400)]
rows[100] = [7] * 600 + [13]
open("/tmp/d.jsonl", "w").write("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
PY
for i in 1 2 3 4; do
  PYTHONPATH=$PWD:$PWD/tests/faults/inject FLEET_INJECT_CUDA_ASSERT_TOKEN=13 timeout 300 python -m worker.extract --model /tmp/m --data /tmp/d.jsonl --out /tmp/out --state /tmp/st --max-tokens-per-batch 4096 --max-skip-fraction 0.1 --compile off > /tmp/log$i 2>&1
  echo "launch $i rc=$?"; tail -c 600 /tmp/log$i; echo
  cat /tmp/out/.fleet/0.suspects.json; echo
  cat /tmp/out/manifest/*.jsonl | wc -l
done
grep skipped /tmp/out/manifest/0.jsonl | head
python -m worker.verify --out /tmp/out | head -c 600
