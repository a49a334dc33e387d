import sys

from minivllm.bench import main

main(["bench", *sys.argv[1:]])
