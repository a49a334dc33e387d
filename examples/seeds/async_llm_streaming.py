# Seed 000 ("Async LLM Streaming"), as written there; only `vllm` became `minivllm`.
# The model is a checkpoint directory at workspace/qwen3-30m-fp16/, relative to the cwd.
import asyncio

from minivllm import SamplingParams
from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.sampling_params import RequestOutputKind
from minivllm.v1.engine.async_llm import AsyncLLM


async def stream_response(engine: AsyncLLM, prompt: str, request_id: str) -> None:
    print(f"\n🚀 Prompt: {prompt!r}")
    print("💬 Response: ", end="", flush=True)

    # Configure sampling parameters for streaming. `output_kind` for getting only new tokens
    # each iteration
    sampling_params = SamplingParams(
        max_tokens=10, temperature=0.8, top_p=0.95, seed=42, output_kind=RequestOutputKind.DELTA
    )

    # Stream tokens from AsyncLLM
    async for output in engine.generate(
        request_id=request_id, prompt=prompt, sampling_params=sampling_params
    ):
        # Process each completion in the output
        for completion in output.outputs:
            # In DELTA mode, we get only new tokens generated since last iteration
            new_text = completion.text
            if new_text:
                print(new_text, end="|", flush=True)
            # Check if generation is finished
            if output.finished:
                print("\n✅ Generation complete!")
                break


async def main():
    print("🔧 Initializing AsyncLLM...")

    # Create AsyncLLM engine with simple configuration. Using eager for faster startup for
    # examples
    engine_args = AsyncEngineArgs(model="workspace/qwen3-30m-fp16/", enforce_eager=True)
    engine = AsyncLLM.from_engine_args(engine_args)
    # Example prompts to demonstrate streaming
    prompts = [
        "The future of artificial intelligence is",
        "In a galaxy far, far away",
        "The key to happiness is",
    ]
    print(f"🎯 Running {len(prompts)} streaming examples...")

    # Process each prompt
    for i, prompt in enumerate(prompts, 1):
        print(f"\n{'=' * 60}")
        print(f"Example {i}/{len(prompts)}")
        print(f"{'=' * 60}")

        request_id = f"stream-example-{i}"
        await stream_response(engine, prompt, request_id)

        # Brief pause between examples
        if i < len(prompts):
            await asyncio.sleep(0.5)
            print("\n🎉 All streaming examples completed!")


asyncio.run(main())
