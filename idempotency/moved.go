package idempotency

import "github.com/keeljobs/keel/internal/jobstore"

// Moved to internal/jobstore; these names go as their callers move.
type (
	BatchCallback = jobstore.BatchCallback
	NewBatch      = jobstore.NewBatch
	Batch         = jobstore.Batch
	BatchFilter   = jobstore.BatchFilter
	Inserted      = jobstore.Inserted
	InsertOptions = jobstore.InsertOptions
	DeadEvent     = jobstore.DeadEvent
	Publisher     = jobstore.Publisher
	Store         = jobstore.Store
	NewJob        = jobstore.NewJob
	Published     = jobstore.Published
	DB            = jobstore.DB
)

var (
	ErrBatchSealed     = jobstore.ErrBatchSealed
	ErrBatchNotFound   = jobstore.ErrBatchNotFound
	InsertChunkRows    = jobstore.InsertChunkRows
	InsertChunkBytes   = jobstore.InsertChunkBytes
	MaxRetryLimit      = jobstore.MaxRetryLimit
	HeaderBusinessKey  = jobstore.HeaderBusinessKey
	AsynqRetryHeadroom = jobstore.AsynqRetryHeadroom
	PublishInFlight    = jobstore.PublishInFlight
	CallbackKey        = jobstore.CallbackKey
	ValidateNewJob     = jobstore.ValidateNewJob
	NewPublisher       = jobstore.NewPublisher
	NewPublisherOn     = jobstore.NewPublisherOn
	NewStore           = jobstore.NewStore
	TaskOptions        = jobstore.TaskOptions
	Task               = jobstore.Task
	NotifyRelay        = jobstore.NotifyRelay
	LookupIn           = jobstore.LookupIn
)
