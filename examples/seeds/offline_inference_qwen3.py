# Seed 000 ("Basic Offline inference"), as written there; only `vllm` became `minivllm`.
# The model is a Hugging Face checkpoint directory at ~/workspace/Qwen3-0.6B/.
import os

# Note: There should be no Warning like: No module named 'vllm._C'
from minivllm import LLM, SamplingParams

# INFO 07-11 09:33:16 [__init__.py:253] Automatically detected platform cpu.

sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
llm = LLM(model=os.path.expanduser("~/workspace/Qwen3-0.6B/"))
prompts = ["Hello, my name is"]
outputs = llm.generate(prompts, sampling_params, stream=True)
print(f"Prompt: {outputs[0].prompt}")
print(f"Output: {outputs[0].outputs[0].text}")
