"""The driver's components: the data feed, launching a layout, step metrics, tracking hooks,
what a run says at start and end. raymp.trainer.Trainer composes them."""
