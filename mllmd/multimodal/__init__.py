"""Images for the vision-language models, from a chat request's URL to the tokens and pixels the model takes.

`image_io` (fetch, check, decode), `image_processing` (resize to the model's grid) and `prompt` (image
placeholders) are torch-free: the main process and the tokenizer worker import them. `patchify` is torch
and runs on the device that runs the vision tower.
"""
