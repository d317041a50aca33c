"""Real-GPU check of fit_batch_size: its size trains a ``transformers.Trainer`` under the same cap.
Skipped without CUDA (or transformers); run with ``bash scripts/gpu_tests.sh``."""

import pytest
import torch

from autobatch import free_memory

if not torch.cuda.is_available():  # before importing transformers: CI without a GPU pays nothing
    pytest.skip("needs a CUDA device", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from autobatch.integrations.transformers import fit_batch_size  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CAP = 3 * 2**30
STEPS = 20


def language_model():
    config = transformers.GPT2Config(vocab_size=16384, n_positions=256, n_embd=256, n_layer=4, n_head=4)
    data = [{"input_ids": torch.randint(0, config.vocab_size, (config.n_positions,))} for _ in range(1024)]

    def collate(samples):
        ids = torch.stack([s["input_ids"] for s in samples])
        return {"input_ids": ids, "labels": ids}
    return transformers.GPT2LMHeadModel(config), data, collate


def vision_model():
    config = transformers.ViTConfig(image_size=96, patch_size=8, hidden_size=256, num_hidden_layers=4,
                                    num_attention_heads=4, intermediate_size=1024, num_labels=10)
    data = [{"pixel_values": torch.randn(3, 96, 96), "labels": i % 10} for i in range(2048)]
    return transformers.ViTForImageClassification(config), data, transformers.default_data_collator


@pytest.mark.parametrize("make, global_batch", [(language_model, None), (vision_model, 1024)], ids=["gpt2-bf16", "vit-global"])
def test_the_size_trains_under_the_cap(tmp_path, make, global_batch):
    """The probed step is the Trainer's own (its inputs held through the step, Accelerate's fp32
    outputs under bf16): the answer trains STEPS steps of ``train()`` under the same cap, with
    the global batch kept where one is asked for."""
    free_memory()
    torch.manual_seed(0)
    model, data, collate = make()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=STEPS, bf16=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_drop_last=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    torch.cuda.set_per_process_memory_fraction(CAP / torch.cuda.get_device_properties(0).total_memory)
    try:
        result = fit_batch_size(trainer, global_batch=global_batch, cache=False)
        print(result.summary())
        trainer.train()  # an OOM here fails the test
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        trainer.model = trainer.model_wrapped = trainer.optimizer = None
        free_memory()
    size, accumulation = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    assert trainer.state.global_step == STEPS and 1 < size <= result.batch_size
    assert size * accumulation == (global_batch or size)


def test_a_model_left_on_the_host_by_bf16_full_eval_is_probed_on_the_gpu(tmp_path):
    """With ``bf16_full_eval`` the Trainer's ``__init__`` leaves the model where it was built
    (here the host) and ``train()`` moves it: the probe moves it first, as ``train()`` would
    (its batches on the GPU met a host model before: a device-mismatch error, no trial)."""
    free_memory()
    torch.manual_seed(0)
    model, data, collate = language_model()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=5, bf16=True, bf16_full_eval=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    assert next(trainer.model.parameters()).device.type == "cpu"  # as the Trainer left it
    torch.cuda.set_per_process_memory_fraction(CAP / torch.cuda.get_device_properties(0).total_memory)
    try:
        result = fit_batch_size(trainer, cache=False)
        assert next(trainer.model.parameters()).device.type == "cuda"
        trainer.train()  # an OOM here fails the test
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        trainer.model = trainer.model_wrapped = trainer.optimizer = None
        free_memory()
    assert trainer.state.global_step == 5 and 1 < trainer.args.per_device_train_batch_size <= result.batch_size


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs in one process")
def test_several_gpus_without_a_launcher_is_one_error_naming_torchrun(tmp_path):
    """A plain ``python`` process that sees two GPUs: ``train()`` would run DataParallel
    (``args.n_gpu`` == 2), which the probe does not model; one error, the arguments untouched."""
    model, data, collate = language_model()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1,
                                          report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    assert args.n_gpu == torch.cuda.device_count() and args.world_size == 1
    with pytest.raises(ValueError, match=r"DataParallel.*torchrun --nproc-per-node"):
        fit_batch_size(trainer, global_batch=64, cache=False)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 1)
