"""The Gradio demo: a live race between plain and speculative decoding."""
