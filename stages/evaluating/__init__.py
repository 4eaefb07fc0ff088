"""The evaluate side's orchestration, above its task kinds (stages/tasks/kind.py): the stage's config
(`config`), the registry of kinds (`kinds`), the checks before a fine-tune (`checks`), every (task, seed)
fine-tuned and results.json written (`scoring`), the held-out masked LM (`heldout`), the models kept
(`kept`) and the continued model beside its start (`versus`). Shared by the evaluate and baseline stages."""
