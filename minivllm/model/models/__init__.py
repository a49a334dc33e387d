"""One module per architecture (the Llama family, OPT, Gemma 3); the registry names them."""
