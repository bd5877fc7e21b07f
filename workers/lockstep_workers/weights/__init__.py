"""A weights version on its way from the trainer to the actors: published as safetensors files on a shared volume,
hashed, staged and verified (``files``); sent over a process group formed for one barrier (``transfer``, and
``gloo_engine``, vLLM's transfer engine over gloo, run inside vLLM's workers); a LoRA adapter's files and config
(``lora``). Used by both processes: the trainer writes and sends, the actor reads and receives.

May import: agent."""
