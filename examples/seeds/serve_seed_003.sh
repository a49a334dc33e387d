#!/bin/sh
# Seed 003's server command and request, with `vllm` replaced by `minivllm`. The model name is
# read from the local Hugging Face cache (HF_HOME / HF_HUB_CACHE); nothing is downloaded.
# `python -m minivllm.entrypoints.api_server` takes the same flags (the simple /generate server).
python -m minivllm.entrypoints.openai.api_server \
 --model facebook/opt-125m \
 --tensor-parallel-size 1 \
 --max-num-seqs 500 \
 --trust-remote-code \
 --enforce-eager \
 --max-num-batched-tokens 512 \
 --enable-chunked-prefill &

# Once it is up:
# curl http://localhost:8000/v1/chat/completions \
#   -H "Content-Type: application/json" \
#   -d '{
#      "model": "facebook/opt-125m",
#      "messages": [{"role": "user", "content": "1 u are loved, sir: They that least lend it you shall lack you first. KING I fill a place"}],
#      "temperature": 0.7,
#      "length_penalty": 1.0,
#      "max_tokens": 100,
#      "min_tokens": 100,
#      "is_latency_sensitive": "True",
#      "slo":0.05
#    }'
wait
