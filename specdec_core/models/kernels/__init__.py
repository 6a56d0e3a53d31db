"""This project's C kernels and their ctypes bindings, each built on first use (native.py): the int4 draft's product
(int4_vnni), the int8 product (int8_vnni), the product on GGUF blocks with each row's attention (kquant), and the
written-out forwards' small operations (step_ops)."""
