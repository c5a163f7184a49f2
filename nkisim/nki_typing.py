"""`nki.typing`: shape annotations such as `X: nt.tensor[128, 512]` (documentation only at run time)."""


class _TensorAnnotation:
    def __init__(self, shape):
        self.shape = shape

    def __repr__(self):
        return f"nt.tensor[{', '.join(map(str, self.shape))}]"


class tensor:  # noqa: N801 - NKI's name
    def __class_getitem__(cls, shape):
        return _TensorAnnotation(shape if isinstance(shape, tuple) else (shape,))


class mutable_tensor(tensor):  # noqa: N801 - legacy neuronxcc.nki.typing name (an annotation for in-place outputs)
    pass


class scalar(tensor):  # noqa: N801 - legacy neuronxcc.nki.typing name
    pass
