# Seed 001 (vLLM's examples/offline_inference/basic.py), as written there; only `vllm` became
# `minivllm`. facebook/opt-125m is read from the local Hugging Face cache (never downloaded).
from minivllm import LLM, SamplingParams

# 提示词
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# 采样参数
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
# 初始化大模型
llm = LLM(model="facebook/opt-125m")
# 生成
outputs = llm.generate(prompts, sampling_params)
# 打印
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
