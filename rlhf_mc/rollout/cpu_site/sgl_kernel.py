"""Stand-in for SGLang's CUDA kernel package `sgl_kernel`, put on an SGLang server's PYTHONPATH on CPU machines.

SGLang's CPU backend imports a few names from sgl_kernel at module level and never calls them on the normal path
(greedy/sampled generation with torch_native attention). Every name resolves here to a function that raises a clear
error if it is ever called, so an unexpected call fails loudly instead of computing something wrong.
"""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} was called, but this CPU machine has only rlhf_mc's stand-in "
                                  "for SGLang's CUDA kernels")

    unavailable.__name__ = name
    return unavailable
