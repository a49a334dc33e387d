# Seed 000's streaming chat client (openai.AsyncOpenAI), as written there: three concurrent
# streams against a server on localhost:8000 serving workspace/qwen3-30m-fp16/.
import asyncio

from openai import AsyncOpenAI

client = AsyncOpenAI(
    base_url="http://localhost:8000/v1",  # 你的 vLLM OpenAI 接口
    api_key="EMPTY",  # vLLM 默认不校验
    timeout=60.0,  # 可调：整体超时
)


async def chat_once(i: int):
    # 发起一个流式请求
    stream = await client.chat.completions.create(
        model="workspace/qwen3-30m-fp16/",  # 换成你加载的模型名
        messages=[
            {"role": "system", "content": "You are concise."},
            {"role": "user", "content": f"任务 #{i}: 用一句话解释什么是流式SSE？"},
        ],
        stream=True,
    )

    print(f"[#{i}] >>> streaming start")
    try:
        async for chunk in stream:
            delta = chunk.choices[0].delta
            if delta and delta.content:
                print(delta.content, end="", flush=True)
    finally:
        # 显式关闭底层连接（可选，便于提早中止）
        await stream.aclose()

    print(f"\n[#{i}] <<< done\n")


async def main():
    # 并发跑多个 streaming，不会阻塞 event loop
    await asyncio.gather(*(chat_once(i) for i in range(3)))


if __name__ == "__main__":
    asyncio.run(main())
