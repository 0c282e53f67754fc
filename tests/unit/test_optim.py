from raymp.optim import lr_factor


def test_warmup_then_cosine_to_floor():
    f = [lr_factor(s, warmup_steps=4, total_steps=20, min_ratio=0.1) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(f[4:], f[5:]))  # monotone decay after warmup
    assert f[4] == 1.0 and abs(lr_factor(20, 4, 20, 0.1) - 0.1) < 1e-12
