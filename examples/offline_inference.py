"""Offline generation and chat with minivllm on the bundled SmolLM2-135M-Instruct."""

from minivllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=48)

llm = LLM()  # or LLM("path/to/hf-model-dir") / LLM("model.gguf")
for output in llm.generate(prompts, sampling_params):
    print(f"{output.prompt!r} -> {output.outputs[0].text!r}")

conversation = [{"role": "user", "content": "Write a haiku about the sea."}]
chat_output = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=64))
print(chat_output[0].outputs[0].text)
