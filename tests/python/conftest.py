"""pytest configuration of tests/python (ctest python_bindings).

layer_torch.py, torch_mask_test.py and torch_grad_test.py are scripts that CTest runs on their
own with the attnbench binary as their argument (layer_torch, torch_masks, torch_grads); they
hold no pytest tests and import torch at module level, so pytest does not collect them."""

collect_ignore = ["layer_torch.py", "torch_mask_test.py", "torch_grad_test.py"]
